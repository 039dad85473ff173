"""reward_model.*: an optional learned scorer on its own mesh (pipeline/reward_model.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from pipeline.config.errors import check, choice, id_set


@dataclass
class RewardModelConfig:
    """reward_model.*: an optional learned scorer, how its score mixes with the task's, its limits."""

    path: str = ""
    """HF checkpoint of a scoring model with a scalar head (AutoModelForSequenceClassification with
    num_labels=1, a <family>ForSequenceClassification; tools/build/train_reward_model.py makes a tiny one
    from task demonstrations); empty: no reward model. It must share the policy's tokenizer, since it
    scores the policy's token ids as they stream (pipeline/reward_model.py). Served on its own mesh."""
    weight: float = 1.0
    """A sample's reward = reward_model.weight * model score + reward_model.task_weight * task reward."""
    task_weight: float = 0.0
    """Weight of the task's verifiable reward() in the training reward when a reward model is set
    (0: the model score alone, and reward() is not called in training). Held-out eval always reports
    the task's reward()."""
    chunk_tokens: int = 16
    """Streaming prefill (OPPO): a response's tokens go to the reward model whenever this many new ones
    were generated, so after EOS only the last chunk is left to prefill; 0 scores the whole sequence
    at EOS (score-at-end)."""
    timeout_s: float = 30.0
    """Seconds a score may take after EOS, a reward-model restart included (> 0); past it the sample
    is rejected as reward_model_timeout (or reward_model_unavailable while it is restarted)."""
    max_batch: int = 16
    """Sequences in one reward-model forward: the streams' next chunks and the whole sequences that
    wait together (1..4096)."""
    max_sequences: int = 4096
    """Streams (prefix caches) the reward model holds at once (1..10^6); past it the least recently
    used is dropped, and its sequence is prefilled whole at EOS."""
    max_restarts: int = 3
    """Restarts of a dead reward-model mesh before the run fails (0..1000)."""
    start_timeout_s: float = 300.0
    """Seconds the reward model may take to load (> 0)."""
    device: str = "cpu"
    """Where the reward model runs: cpu | cuda (the proc's first visible GPU)."""
    cpus: str = ""
    """Cores of the reward model's proc (on host 0), cpuset syntax ('' = not pinned), one torch
    thread per core."""

    def __post_init__(self) -> None:
        if self.path:
            check(Path(self.path).is_dir() and (Path(self.path) / "config.json").is_file(), "reward_model.path",
                  self.path, "an HF checkpoint directory (with config.json), or empty for no reward model")
            self.path = str(Path(self.path).resolve())
        for key in ("weight", "task_weight"):
            check(math.isfinite(getattr(self, key)), f"reward_model.{key}", getattr(self, key), "a finite number")
        check(self.weight != 0 or self.task_weight != 0 or not self.path, "reward_model.weight", self.weight,
              "non-zero (or reward_model.task_weight non-zero): the reward would be 0 for every sample")
        check(0 <= self.chunk_tokens <= 131072, "reward_model.chunk_tokens", self.chunk_tokens,
              "0 (score at end) .. 131072")
        check(self.timeout_s > 0, "reward_model.timeout_s", self.timeout_s, "> 0")
        check(1 <= self.max_batch <= 4096, "reward_model.max_batch", self.max_batch, "1..4096")
        check(1 <= self.max_sequences <= 1_000_000, "reward_model.max_sequences", self.max_sequences, "1..1000000")
        check(0 <= self.max_restarts <= 1000, "reward_model.max_restarts", self.max_restarts, "0..1000")
        check(self.start_timeout_s > 0, "reward_model.start_timeout_s", self.start_timeout_s, "> 0")
        choice("reward_model.device", self.device, ("cpu", "cuda"))
        id_set("reward_model.cpus", self.cpus)

