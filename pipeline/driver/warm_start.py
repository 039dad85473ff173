"""Supervised warm start on task demonstrations, before RL (run.warm_start_steps).

    ids, mask = demo_batch(tokenizer, task, items, enable_thinking)   # the tokens the generators would produce
    warm_dir = await warm_start(cfg, task, trainer, tokenizer, steps)   # trained, exported for the generators
    report = await auto_warm_start(cfg, task, trainer, tokenizer, fleet, evaluation)   # run.warm_start_steps=auto

An integer count runs before any generator exists: the export is what they start from. `auto`
runs once the generators serve the initial weights (version 0) and before generation begins: after
each chunk of run.warm_start_chunk steps the trainer exports, every generator reloads the export in
place (still version 0) and a held-out probe (Evaluation.probe, buffer.group_size samples per
prompt at generator.temperature) tells the stopping rule (learning_signal.WarmStartRule) whether RL
has signal yet. A probe comes first, before any step: a policy that already has signal is not
warm-started at all.

Either way RL starts with a fresh AdamW (`hand_over`): the supervised steps' moments and step counts
are dropped, so the first RL steps are not pushed along the demonstrations' momentum nor scaled by
their gradients' second moments (docs/results/audit-warm-start.md measures both).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from pipeline.config import Config
from pipeline.driver.calls import RunError, call_within
from pipeline.driver.learning_signal import Probe, WarmStartRule
from pipeline.tasks import PromptStream
from pipeline.tokens import SpecialTokens, encode_completion, encode_prompt, observation_frame
from pipeline.types import PromptItem

log = logging.getLogger(__name__)


def demo_batch(tokenizer: Any, task: Any, items: Iterable[PromptItem],
               enable_thinking: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, loss mask) of the items' demonstrations, laid out as the generators lay out a rollout:
    the prompt tokenized as they do (pipeline.tokens.encode_prompt, task.enable_thinking: the same
    tokens in RL), then each model turn ending as the generators' turns end (SpecialTokens.end_of_turn:
    the chat template's end of turn after a chat prompt, eos after a str)
    and trained on, each observation (multi-turn: model turn, observation, model turn, ...)
    tokenized on its own, in a chat prompt's frame, and masked out (pipeline/generator/envs.py);
    the checkpoint's pad to the longest row."""
    special = SpecialTokens.of(tokenizer)
    seqs, masks = [], []
    for it in items:
        p = encode_prompt(tokenizer, it.prompt, enable_thinking)
        frame = observation_frame(tokenizer, it.prompt, enable_thinking)
        demo = task.demonstration(it)
        seq, mask = list(p), [0.0] * len(p)
        for k, text in enumerate([demo] if isinstance(demo, str) else list(demo)):
            ids = encode_completion(tokenizer, text)
            ids = ids + [special.end_of_turn(it.prompt)] if k % 2 == 0 else frame.wrap(ids, seq[-1])
            seq += ids
            mask += [1.0 if k % 2 == 0 else 0.0] * len(ids)
        seqs.append(seq)
        masks.append(mask)
    t = max(map(len, seqs))
    ids = torch.tensor([s + [special.pad] * (t - len(s)) for s in seqs])
    mask = torch.tensor([m + [0.0] * (t - len(m)) for m in masks])
    return ids, mask


async def warm_start(cfg: Config, task: Any, trainer: Any, tokenizer: Any, steps: int) -> Path:
    """`steps` supervised steps on task demonstrations (a batch of buffer.batch_groups x group_size
    items each), then the trainer exports the result for the generators to start from and hands
    over to RL (`hand_over`: AdamW afresh, the KL reference). Returns the export's directory. Runs
    before any generator exists, so nothing overlaps it."""
    if task.demonstration is None:
        raise RunError(f"run.warm_start_steps={steps} but task {task.name} has no demonstration()")
    demos = Demonstrations(cfg, task, trainer, tokenizer)
    loss = float("nan")
    for _ in range(steps):
        loss = await demos.step()
    warm_dir = Path(cfg.run.out_dir) / "warm_start"
    await trainer.export_hf(str(warm_dir))
    await hand_over(trainer)
    log.info("warm start: %d supervised steps on demonstrations, final loss %.4f", steps, loss)
    return warm_dir


async def hand_over(trainer: Any) -> None:
    """After the supervised steps, before RL: AdamW's moments and step counts are dropped, so the
    first RL step starts the optimizer afresh (as a run without a warm start does) instead of taking
    the demonstrations' momentum and gradient scale; with a KL term the warm-started policy becomes
    the reference."""
    await trainer.reset_optimizer()
    if await trainer.set_reference():
        log.info("warm start: the KL reference (trainer.kl_coef) is the warm-started policy")


class Demonstrations:
    """The warm start's supervised steps: each on a batch of buffer.batch_groups x group_size items
    of the task's train split (its own stream, seeded apart from RL's), at run.warm_start_lr."""

    def __init__(self, cfg: Config, task: Any, trainer: Any, tokenizer: Any):
        self.cfg, self.task, self.trainer, self.tokenizer = cfg, task, trainer, tokenizer
        self.items = PromptStream(task, cfg.task.seed + 7919)  # a finite split cycles in epochs
        self.n = cfg.buffer.batch_groups * cfg.buffer.group_size

    async def step(self) -> float:
        """One supervised step; its loss."""
        ids, mask = demo_batch(self.tokenizer, self.task, [next(self.items) for _ in range(self.n)],
                               self.cfg.task.enable_thinking)
        return (await self.trainer.sft_step(ids, mask, self.cfg.run.warm_start_lr or None))["loss"]


@dataclass
class WarmReport:
    """Where and why the warm start stopped, and the held-out probes before and after it (None
    without held-out prompts). `line()` is what the run logs and prints."""

    steps: int
    reason: str
    mode: str  # "auto" or "fixed"
    before: Probe | None = None
    after: Probe | None = None
    loss: float = float("nan")

    def line(self) -> str:
        out = f"warm start: stopped after {self.steps} steps: {self.reason}"
        if self.before is not None and self.after is not None and self.before.prompts and self.after.prompts:
            out += (f"; held-out sampled reward {self.before.mean_reward:.3f} -> {self.after.mean_reward:.3f}, "
                    f"groups with a spread {self.before.spread:.2f} -> {self.after.spread:.2f}")
        return out

    def summary(self) -> dict:
        return {"steps": self.steps, "reason": self.reason, "mode": self.mode, "final_loss": self.loss,
                "before": None if self.before is None else self.before.__dict__,
                "after": None if self.after is None else self.after.__dict__}

    def metrics(self) -> dict[str, float]:
        out = {"warm_start/steps": float(self.steps), "warm_start/loss": self.loss}
        for name, p in (("before", self.before), ("after", self.after)):
            if p is not None:
                out |= p.metrics(f"warm_start/{name}")
        return out


async def auto_warm_start(cfg: Config, task: Any, trainer: Any, tokenizer: Any, fleet: Any, evaluation: Any) -> WarmReport:
    """run.warm_start_steps=auto (see the module docstring). Runs after the generators started and
    before generation begins; nothing else calls the trainer or the generators meanwhile. Returns
    the report; the generators serve the warm-started weights (version 0) and the trainer has handed
    over to RL (`hand_over`)."""
    if task.demonstration is None:
        return WarmReport(0, f"task {task.name} has no demonstration()", "auto")
    rule, g = WarmStartRule.of(cfg.run), cfg.buffer.group_size
    held_out = bool(evaluation.items()) and g >= 2

    async def probe() -> Probe | None:
        return Probe.of(await evaluation.probe(g), g) if held_out else None

    demos, warm_dir = Demonstrations(cfg, task, trainer, tokenizer), Path(cfg.run.out_dir) / "warm_start"
    steps, losses = 0, []
    before = after = await probe()
    while (why := rule.decide(steps, after, losses)) is None:
        chunk = [await demos.step() for _ in range(min(cfg.run.warm_start_chunk, cfg.run.warm_start_max_steps - steps))]
        steps += len(chunk)
        losses.append(statistics.fmean(chunk))
        if held_out:
            await reload(fleet, trainer, warm_dir, cfg.weight_sync.timeout_s)
            after = await probe()
        log.info("warm start: %d steps, mean loss %.4f%s", steps, losses[-1], f"; {after.text()}" if after else "")
    if steps and not held_out:  # no probe reloaded them: the generators take the final weights now
        await reload(fleet, trainer, warm_dir, cfg.weight_sync.timeout_s)
    elif not steps:  # out_dir/warm_start is the RL start, as after any warm start (tools/compare/peer_compare.py reads it)
        await trainer.export_hf(str(warm_dir))
    if steps:
        await hand_over(trainer)
    if not held_out:
        why += " (no held-out probe: the task has no eval prompts, or buffer.group_size is 1)"
    return WarmReport(steps, why, "auto", before, after, losses[-1] if losses else float("nan"))


async def reload(fleet: Any, trainer: Any, hf_dir: Path, timeout_s: float) -> None:
    """The trainer's weights exported to `hf_dir`, then served by every live generator (in place)."""
    await trainer.export_hf(str(hf_dir))
    await call_within("reload_weights", asyncio.gather(
        *[s.handle.reload_weights.call_one(str(hf_dir)) for _, s in fleet.live_generators()]), timeout_s + 60)
