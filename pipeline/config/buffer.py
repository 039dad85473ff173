"""buffer.*: the replay buffer and its over-commitment controller (pipeline/buffer.py, pipeline/overcommit.py)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config.errors import check, choice, id_set
from pipeline.config.recipes import resolve_buffer


@dataclass
class BufferConfig:
    """buffer.*: group and batch shape, staleness bound, over-commitment Δ, what is dropped or retried."""

    group_size: int = 4
    """G: samples per prompt group (1..1024)."""
    batch_groups: int = 4
    """B: prompt groups per training step (1..65536)."""
    max_staleness: int = 1
    """Drop samples whose staleness (trainer version - oldest token version) exceeds this (0..1000)."""
    overcommit: str = "adaptive"
    """Over-commitment Δ: none (Δ=0, synchronous batching) | fixed (Δ=delta) | adaptive (OPPO reward slope)."""
    delta: int = 2
    """Fixed Δ, and the starting Δ when adaptive (0..65536)."""
    delta_min: int = 0
    """Smallest adaptive Δ (0..delta_max)."""
    delta_max: int = 8
    """Largest adaptive Δ (>= delta_min)."""
    window: int = 8
    """w: steps in the reward-slope window of the adaptive Δ controller (3..1000; the slope's
    standard error has w - 2 degrees of freedom, so small windows make the t-statistic erratic)."""
    slope_tstat: float = 2.0
    """Δ grows only while the window's reward slope / its standard error exceeds this (>= 0), i.e.
    while the reward is significantly rising; otherwise Δ decays. 0 grows on any positive slope."""
    normalize_std: bool | None = None
    """Divide group-relative advantages by the group's reward std (a loss-recipe part, trainer.recipe:
    true unless the recipe is dr_grpo; a value set here wins)."""
    retry_stale: bool = True
    """A group dropped as stale was never trained on: admit its prompt again (before new prompts), so
    a finite dataset loses no prompt to staleness. Counted in the buffer stats as retried_prompts."""
    zero_signal: str | None = None
    """Groups whose task rewards are all equal (no learning signal under group-relative advantages; read
    before DAPO's overlong shaping): keep (trained at zero advantage) | drop (DAPO dynamic sampling: not
    trained, counted as dropped zero_signal, and admission replaces them so batches fill with groups that
    carry signal; what trainer.recipe=dapo sets when group_size > 1 and this key is not named) | auto
    (the default: keep until the pre-flight probe of a fresh run, then drop when fewer than half of
    the held-out groups have a reward spread, else keep; keep when a teacher's per-token distillation
    is on (teacher.hf_dir with trainer.distill_coef > 0), when there is no probe (no held-out prompts,
    group_size 1) and on a resume, which keeps the checkpoint's choice; pipeline/driver/learning_signal.py)."""
    set_aside_samples: int = 16
    """Online difficulty filter (pipeline/difficulty.py): a prompt is set aside once its last groups in a
    row all got one and the same reward (always solved, or never) over at least this many samples, i.e.
    after ceil(n / group_size) such groups (2 at group_size 8), so the prompts drawn instead carry signal
    (0..100000; 0 turns the filter off). Counted per prompt text, over every generator's groups."""
    retry_after: int = 32
    """Trainer steps a set-aside prompt waits before the stream may admit it again (1..10^6); each time it
    is set aside again the wait doubles, up to 16x. A finite split's prompts all come back (nothing starves)."""
    batch_timeout_s: float = 600.0
    """Seconds the trainer waits for a batch before the run fails."""
    cpus: str = ""
    """Cores of the replay buffer's proc (on host 0), cpuset syntax ('0', '0-1'; '' = not pinned, the
    default), with one torch thread per core."""

    def __post_init__(self) -> None:
        resolve_buffer(self)  # recipe parts: pipeline/config/recipes.py
        check(1 <= self.group_size <= 1024, "buffer.group_size", self.group_size, "1..1024")
        check(1 <= self.batch_groups <= 65536, "buffer.batch_groups", self.batch_groups, "1..65536")
        check(0 <= self.max_staleness <= 1000, "buffer.max_staleness", self.max_staleness, "0..1000")
        choice("buffer.overcommit", self.overcommit, ("none", "fixed", "adaptive"))
        check(0 <= self.delta <= 65536, "buffer.delta", self.delta, "0..65536")
        check(0 <= self.delta_min <= self.delta_max, "buffer.delta_min", self.delta_min,
              f"0..delta_max={self.delta_max}")
        check(3 <= self.window <= 1000, "buffer.window", self.window, "3..1000")
        check(self.slope_tstat >= 0, "buffer.slope_tstat", self.slope_tstat, ">= 0")
        choice("buffer.zero_signal", self.zero_signal, ("auto", "keep", "drop"))
        check(0 <= self.set_aside_samples <= 100_000, "buffer.set_aside_samples", self.set_aside_samples,
              "0..100000 (0: off)")
        check(1 <= self.retry_after <= 1_000_000, "buffer.retry_after", self.retry_after, "1..1000000")
        check(self.batch_timeout_s > 0, "buffer.batch_timeout_s", self.batch_timeout_s, "> 0")
        id_set("buffer.cpus", self.cpus)

