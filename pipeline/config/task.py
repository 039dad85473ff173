"""task.*: the prompts, the reward and the environment of a run (pipeline/tasks/, pipeline/generator/envs.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.config.errors import check


@dataclass
class TaskConfig:
    """task.*: the task plug-in, its data files, reward and environment limits."""

    name: str = "pipeline.tasks.reverse"
    """Dotted path of a task module or object providing `prompts(...)` and `reward(prompt, completion)`."""
    seed: int = 0
    """Seed of the prompt stream: passed to prompts(seed, split); also seeds the per-epoch shuffle of a
    finite train split (pipeline/tasks/__init__.py)."""
    eval_prompts: int = 32
    """Held-out prompts scored for the learning curve (0..100000); a shorter eval split is used whole."""
    path: str = ""
    """Data file of a file-based task (pipeline.tasks.jsonl: its train split, one JSON object per line);
    empty for tasks that need none. Must exist; read relative to the working directory, kept absolute."""
    eval_path: str = ""
    """Eval split file of a file-based task (pipeline.tasks.jsonl); empty: no eval split. Must exist if set."""
    reward_timeout_s: float = 30.0
    """Seconds one reward call may run (> 0); past it the sample is rejected as reward_timeout."""
    reward_workers: int = 4
    """Reward calls run at once per process, on threads off the event loop (1..256)."""
    max_reject_frac: float = 0.2
    """The run stops when more than this fraction of a generator's recent samples (its last 200,
    once 20 were seen) were rejected: a reward that raised, was NaN/inf or not a number, timed out,
    an environment that raised or timed out, or a prompt that was empty, too long or not
    tokenisable (0 < x <= 1; 1 never stops)."""
    env: str = ""
    """Multi-turn: dotted path of an environment factory `env(item) -> Env` (pipeline/generator/envs.py); empty:
    the task's own `env` if it has one, else single-turn."""
    max_turns: int = 4
    """Multi-turn: model turns per rollout (1..256); the episode ends after the last one."""
    max_total_tokens: int = 64
    """Multi-turn: completion tokens per rollout, model and environment together (1..131072); a turn
    gets at most generator.max_new_tokens of them."""
    max_obs_tokens: int = 32
    """Multi-turn: tokens one observation may add (1..131072); longer ones are cut and counted as
    obs_truncated."""
    env_timeout_s: float = 10.0
    """Seconds one environment call (env(item), step) may run (> 0); past it the sample is rejected
    as env_timeout. Calls run on threads off the event loop, like rewards."""
    enable_thinking: bool | None = None
    """Chat prompts (a task's prompt given as a list of messages): passed to the checkpoint's chat
    template as `enable_thinking` (Qwen3: false renders an empty think block, so the model answers
    at once); null (the default): not passed, the template's own default. Unused for str prompts."""

    def __post_init__(self) -> None:
        check(bool(self.name) and "." in self.name, "task.name", self.name, "a dotted path like 'pkg.module'")
        check(0 <= self.eval_prompts <= 100000, "task.eval_prompts", self.eval_prompts, "0..100000")
        check(self.reward_timeout_s > 0, "task.reward_timeout_s", self.reward_timeout_s, "> 0")
        check(1 <= self.reward_workers <= 256, "task.reward_workers", self.reward_workers, "1..256")
        check(0 < self.max_reject_frac <= 1, "task.max_reject_frac", self.max_reject_frac, "0 < x <= 1")
        check(not self.env or "." in self.env, "task.env", self.env, "a dotted path like 'pkg.module.factory', or empty")
        check(1 <= self.max_turns <= 256, "task.max_turns", self.max_turns, "1..256")
        check(1 <= self.max_total_tokens <= 131072, "task.max_total_tokens", self.max_total_tokens, "1..131072")
        check(1 <= self.max_obs_tokens <= 131072, "task.max_obs_tokens", self.max_obs_tokens, "1..131072")
        check(self.env_timeout_s > 0, "task.env_timeout_s", self.env_timeout_s, "> 0")
        for key in ("path", "eval_path"):
            value = getattr(self, key)
            if value:  # absolute: every process (generators, buffer) reads the same file whatever its cwd
                check(Path(value).is_file(), f"task.{key}", value, "an existing file (or empty)")
                setattr(self, key, str(Path(value).resolve()))

