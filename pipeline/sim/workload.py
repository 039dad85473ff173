"""The simulated run's workload: each prompt's token count and its G response lengths, and the reward.

Three sources of lengths, named by a spec string (`--lengths` of `python -m tools.plan`):

    task                  the configured task's own prompt stream (pipeline.tasks.PromptStream, the
                          buffer's order) with generator.ignore_eos=true: a response is exactly its
                          prompt's budget (PromptItem.max_new_tokens, else generator.max_new_tokens),
                          so lengths are known without a model. With ignore_eos=false they depend on
                          the model: an error, pass a run's rollouts.jsonl instead.
    <path>/rollouts.jsonl a run's logged rollouts (run.log_rollouts): lengths drawn from the logged
                          completions (len(versions)), independently per sample, prompts from the task
    lognormal:M,S,CAP[,P] lengths LogNormal(log M, S) capped at CAP, one per group (as the long-tail
                          task), P prompt tokens (default 16); for paper scenarios

Prompt tokens are counted with the checkpoint's tokenizer (pipeline.tokens.encode_prompt), as the
generators do. The reward (`RewardCurve`) only feeds the adaptive Δ controller: a per-step mean,
flat, rising, or replayed from a run's metrics.jsonl, plus per-sample noise.

Example:
    w = workload_from_spec("task", cfg, seed=0)
    item = w.next_item()                  # PromptItem (uid, prompt)
    prompt_len, lengths = w.shape(item)   # e.g. 11, (14, 14, 14, 14)
"""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import Config
from pipeline.types import PromptItem

__all__ = ["Workload", "RewardCurve", "WorkloadError", "workload_from_spec", "reward_from_spec"]


class WorkloadError(ValueError):
    """A workload the simulator cannot model; the message names the key or file."""


class Workload:
    """Prompts in the order the buffer draws them, and per prompt (prompt tokens, G lengths).
    `shape` is memoised per uid, so a prompt retried after a stale drop has the same shape."""

    def __init__(self, items, shape_fn, group_size: int, describe: str):
        self._items, self._shape_fn, self.G, self.describe = items, shape_fn, group_size, describe
        self._shapes: dict[int, tuple[int, tuple[int, ...]]] = {}

    def next_item(self) -> PromptItem | None:
        return next(self._items, None)

    def shape(self, item: PromptItem) -> tuple[int, tuple[int, ...]]:
        if item.uid not in self._shapes:
            self._shapes[item.uid] = self._shape_fn(item)
        return self._shapes[item.uid]


def _tokenizer_counter(cfg: Config):
    from pipeline.models.hf import model_dir
    from pipeline.tokens import encode_prompt, load_tokenizer

    tok = load_tokenizer(model_dir(cfg.model))
    cache: dict = {}

    def count(prompt) -> int:
        key = prompt if isinstance(prompt, str) else json.dumps(prompt)
        if key not in cache:
            cache[key] = len(encode_prompt(tok, prompt, cfg.task.enable_thinking))
        return cache[key]
    return count


def _task_items(cfg: Config):
    from pipeline.tasks import PromptStream, load_task

    return iter(PromptStream(load_task(cfg.task.name, cfg.task), cfg.task.seed, epochs=cfg.run.epochs))


def workload_from_spec(spec: str, cfg: Config, seed: int = 0) -> Workload:
    """The workload named by `spec` (module docstring); WorkloadError for one that cannot be modelled."""
    g, G = cfg.generator, cfg.buffer.group_size
    if spec.startswith("lognormal:"):
        try:
            parts = [float(x) for x in spec.split(":", 1)[1].split(",")]
            median, sigma, cap = parts[:3]
            ptoks = int(parts[3]) if len(parts) > 3 else 16
        except (ValueError, IndexError):
            raise WorkloadError(f"lengths {spec!r}: expected lognormal:MEDIAN,SIGMA,CAP[,PROMPT_TOKENS]") from None
        cap = min(int(cap), g.max_new_tokens)
        rng = random.Random(seed + 17)

        def shape_ln(item: PromptItem):
            n = max(1, min(cap, round(math.exp(rng.gauss(math.log(median), sigma)))))
            return ptoks, (n,) * G
        items = (PromptItem(uid=i, prompt="") for i in itertools.count())
        return Workload(items, shape_ln, G, f"lognormal median {median:g}, sigma {sigma:g}, cap {cap}, {ptoks} prompt tokens")
    if spec == "task":
        if not g.ignore_eos:
            raise WorkloadError(f"lengths 'task': task {cfg.task.name} with generator.ignore_eos=false has lengths "
                                "the model decides; pass a run's rollouts.jsonl (--lengths path/rollouts.jsonl)")
        count = _tokenizer_counter(cfg)

        def shape_task(item: PromptItem):
            n = min(item.max_new_tokens or g.max_new_tokens, g.max_new_tokens)
            return count(item.prompt), (n,) * G
        return Workload(_task_items(cfg), shape_task, G, f"task {cfg.task.name} budgets (ignore_eos), cap {g.max_new_tokens}")
    path = Path(spec)
    if path.name.endswith(".jsonl"):
        if not path.is_file():
            raise WorkloadError(f"lengths {spec!r}: no such file")
        lengths = []
        for i, line in enumerate(path.read_text().splitlines(), 1):
            try:
                row = json.loads(line)
                lengths.append(len(row["versions"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise WorkloadError(f"{path}:{i}: not a rollouts.jsonl row with 'versions'") from None
        lengths = [min(max(n, 1), g.max_new_tokens) for n in lengths]
        if not lengths:
            raise WorkloadError(f"{path}: no rollouts")
        count, rng = _tokenizer_counter(cfg), random.Random(seed + 17)

        def shape_rollouts(item: PromptItem):
            return count(item.prompt), tuple(rng.choice(lengths) for _ in range(G))
        return Workload(_task_items(cfg), shape_rollouts, G, f"{len(lengths)} logged lengths from {path}")
    raise WorkloadError(f"lengths {spec!r}: expected 'task', a rollouts.jsonl path or lognormal:M,S,CAP[,P]")


@dataclass(frozen=True)
class RewardCurve:
    """Mean reward of samples begun on version v; each sample adds N(0, noise), clipped to [0, 1]."""

    kind: str  # flat | rising | replay
    start: float = 0.0
    end: float = 0.0
    tau: float = 1.0
    noise: float = 0.1
    replay: tuple[float, ...] = ()

    def mean(self, version: int) -> float:
        if self.kind == "replay":
            return self.replay[min(version, len(self.replay) - 1)]
        if self.kind == "rising":
            return self.end + (self.start - self.end) * math.exp(-version / self.tau)
        return self.start

    def sample(self, version: int, rng: random.Random) -> float:
        return min(max(self.mean(version) + rng.gauss(0.0, self.noise), 0.0), 1.0)


def reward_from_spec(spec: str) -> RewardCurve:
    """flat:MEAN[,NOISE] | rising:START,END,TAU[,NOISE] | <path>/metrics.jsonl (reward/mean per step)."""
    try:
        if spec.startswith("flat:"):
            p = [float(x) for x in spec[5:].split(",")]
            return RewardCurve("flat", start=p[0], noise=p[1] if len(p) > 1 else 0.1)
        if spec.startswith("rising:"):
            p = [float(x) for x in spec[7:].split(",")]
            return RewardCurve("rising", start=p[0], end=p[1], tau=p[2], noise=p[3] if len(p) > 3 else 0.1)
    except (ValueError, IndexError):
        raise WorkloadError(f"reward {spec!r}: expected flat:MEAN[,NOISE] or rising:START,END,TAU[,NOISE]") from None
    path = Path(spec)
    if path.name.endswith(".jsonl") and path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        vals = tuple(float(r["reward/mean"]) for r in rows if "reward/mean" in r)
        if not vals:
            raise WorkloadError(f"reward {path}: no 'reward/mean' rows")
        return RewardCurve("replay", replay=vals, noise=0.0)
    raise WorkloadError(f"reward {spec!r}: expected flat:..., rising:... or an existing metrics.jsonl")
