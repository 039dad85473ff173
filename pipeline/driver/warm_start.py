"""Supervised warm start on task demonstrations, before RL (run.warm_start_steps).

    ids, mask = demo_batch(tokenizer, task, items, enable_thinking)   # the tokens the generators would produce
    warm_dir = await warm_start(cfg, task, trainer, tokenizer, steps)   # trained, exported for the generators
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable

import torch

from pipeline.config import Config
from pipeline.driver.calls import RunError
from pipeline.tasks import PromptStream
from pipeline.tokens import SpecialTokens, encode_completion, encode_prompt, observation_frame
from pipeline.types import PromptItem

log = logging.getLogger(__name__)


def demo_batch(tokenizer: Any, task: Any, items: Iterable[PromptItem],
               enable_thinking: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, loss mask) of the items' demonstrations, laid out as the generators lay out a rollout:
    the prompt tokenized as they do (pipeline.tokens.encode_prompt, task.enable_thinking: the same
    tokens in RL), then each model turn ending with the checkpoint's eos (a chat model's end of turn)
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
            ids = ids + [special.eos] if k % 2 == 0 else frame.wrap(ids, seq[-1])
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
    items each), then the trainer exports the result for the generators to start from and, with a
    KL term, takes it as the reference. Returns the export's directory. Runs before any generator
    exists, so nothing overlaps it."""
    if task.demonstration is None:
        raise RunError(f"run.warm_start_steps={steps} but task {task.name} has no demonstration()")
    items = PromptStream(task, cfg.task.seed + 7919)  # a finite split cycles in epochs
    n = cfg.buffer.batch_groups * cfg.buffer.group_size
    loss = float("nan")
    for _ in range(steps):
        ids, mask = demo_batch(tokenizer, task, [next(items) for _ in range(n)], cfg.task.enable_thinking)
        loss = (await trainer.sft_step(ids, mask, cfg.run.warm_start_lr or None))["loss"]
    warm_dir = Path(cfg.run.out_dir) / "warm_start"
    await trainer.export_hf(str(warm_dir))
    if await trainer.set_reference():
        log.info("warm start: the KL reference (trainer.kl_coef) is the warm-started policy")
    log.info("warm start: %d supervised steps on demonstrations, final loss %.4f", steps, loss)
    return warm_dir
