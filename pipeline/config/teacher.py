"""teacher.*: on-policy distillation's teacher, a causal LM on its own mesh (pipeline/teacher.py)."""

from __future__ import annotations

import math
import string
from dataclasses import dataclass
from pathlib import Path

from pipeline.config.errors import check, choice, id_set

SELF = "self"
"""teacher.hf_dir=self: the teacher is the student's initial weights (self-distillation)."""


def context_fields(template: str) -> list[str]:
    """The `{column}` names a teacher.context template reads (ValueError if it is malformed)."""
    return [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]


@dataclass
class TeacherConfig:
    """teacher.*: a teacher that scores every token the student samples (on-policy distillation)."""

    hf_dir: str = ""
    """HF checkpoint of the teacher, a causal LM of a supported family whose tokenizer matches the
    student's (same vocabulary, special ids and end-of-turn token; checked before anything starts);
    `self`: the student's own initial weights (self-distillation, usually with teacher.context);
    empty: no teacher. Served on its own mesh, scoring as the tokens arrive (pipeline/teacher.py)."""
    context: str = ""
    """Privileged context for the teacher's prompt only: a template over the item's columns
    (`{answer}`, a dataset's other columns, `{prompt}`), e.g. 'The correct final answer is {answer}.'.
    It is added after the last user turn's text (a chat prompt) or before a plain prompt; the
    student never sees it. Empty: the teacher reads the student's prompt."""
    chunk_tokens: int = 16
    """Streaming: a rollout's tokens go to the teacher whenever this many new ones were generated,
    so after EOS only the last chunk is left to score; 0 scores the whole sequence at EOS."""
    timeout_s: float = 60.0
    """Seconds the teacher's log-probs may take after EOS, a teacher restart included (> 0); past it
    the sample is rejected as teacher_timeout (or teacher_unavailable while it is restarted)."""
    max_batch: int = 16
    """Sequences in one teacher forward (1..4096)."""
    max_sequences: int = 4096
    """Streams (prefix caches) the teacher holds at once (1..10^6); past it the least recently used
    is dropped, and its sequence is scored whole at EOS."""
    max_restarts: int = 3
    """Restarts of a dead teacher mesh before the run fails (0..1000)."""
    start_timeout_s: float = 300.0
    """Seconds the teacher may take to load (> 0)."""
    device: str = "cpu"
    """Where the teacher runs: cpu | cuda (the proc's first visible GPU)."""
    dtype: str = "float32"
    """The teacher's compute dtype: float32 | bfloat16 | float16; log-probs are always taken in float32."""
    cpus: str = ""
    """Cores of the teacher's proc (on host 0), cpuset syntax ('' = not pinned), one torch thread per core."""
    devices: str = ""
    """GPU id of the teacher's proc (device=cuda; '' = the proc's first visible GPU)."""

    def __post_init__(self) -> None:
        if self.hf_dir and self.hf_dir != SELF:
            check(Path(self.hf_dir).is_dir() and (Path(self.hf_dir) / "config.json").is_file(), "teacher.hf_dir",
                  self.hf_dir, "an HF checkpoint directory (with config.json), 'self', or empty for no teacher")
            self.hf_dir = str(Path(self.hf_dir).resolve())
        try:
            names = context_fields(self.context)
        except ValueError as e:
            check(False, "teacher.context", self.context, f"a format template with {{column}} fields ({e})")
        check(all(n and n.isidentifier() for n in names), "teacher.context", self.context,
              "a template whose fields are plain column names, like {answer}")
        check(not self.context or bool(self.hf_dir), "teacher.context", self.context,
              "empty unless teacher.hf_dir is set")
        check(0 <= self.chunk_tokens <= 131072, "teacher.chunk_tokens", self.chunk_tokens, "0 (score at end) .. 131072")
        check(self.timeout_s > 0 and math.isfinite(self.timeout_s), "teacher.timeout_s", self.timeout_s, "> 0")
        check(1 <= self.max_batch <= 4096, "teacher.max_batch", self.max_batch, "1..4096")
        check(1 <= self.max_sequences <= 1_000_000, "teacher.max_sequences", self.max_sequences, "1..1000000")
        check(0 <= self.max_restarts <= 1000, "teacher.max_restarts", self.max_restarts, "0..1000")
        check(self.start_timeout_s > 0, "teacher.start_timeout_s", self.start_timeout_s, "> 0")
        choice("teacher.device", self.device, ("cpu", "cuda"))
        choice("teacher.dtype", self.dtype, ("float32", "bfloat16", "float16"))
        id_set("teacher.cpus", self.cpus)
        check(not id_set("teacher.devices", self.devices, "GPU") or self.device == "cuda", "teacher.devices",
              self.devices, "'' when teacher.device='cpu'")
