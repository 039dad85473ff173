"""The warm start's hand-over to RL (pipeline/driver/warm_start.py) on one in-process TrainCore of
the tiny model: the first RL step after the supervised steps starts AdamW afresh, so it is the step a
run that started from the warm-started weights without a warm start would take.

    .venv/bin/python -m pytest -q tests/test_warm_start.py     # seconds, no mesh
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from pipeline.config import BufferConfig, Config, ModelConfig, RunConfig, TaskConfig, TrainerConfig
from pipeline.driver.warm_start import auto_warm_start, warm_start
from pipeline.models.hf import model_dir
from pipeline.models.tiny import ensure_tiny
from pipeline.tasks import load_task
from pipeline.tokens import load_tokenizer
from pipeline.trainer.step import TrainCore
from pipeline.trainer.synthetic import synthetic_batch

from .conftest import REPO


class InProcess:
    """The trainer calls the warm start makes (actors/trainer.py Trainer), on one TrainCore."""

    def __init__(self, core: TrainCore) -> None:
        self.core = core

    async def sft_step(self, ids, mask, lr=None):
        return self.core.sft_step(ids, mask, lr)

    async def export_hf(self, path, merged=False):
        self.core.state.export_hf(path, merged)
        return self.core.version

    async def set_reference(self):
        return self.core.state.set_reference()

    async def reset_optimizer(self):
        self.core.state.reset_optimizer()


class NoGenerators:
    def live_generators(self):
        return []


class NoEvalPrompts:
    def items(self):
        return []


def config(tmp_path) -> Config:
    return Config(model=ModelConfig(hf_dir=str(ensure_tiny(cache_dir=REPO / ".cache" / "tiny-model"))),
                  trainer=TrainerConfig(lr=1e-3, kl_coef=0.0),
                  buffer=BufferConfig(batch_groups=2, group_size=2),
                  task=TaskConfig(name="pipeline.tasks.reverse", eval_prompts=0),
                  run=RunConfig(out_dir=str(tmp_path), warm_start_lr=1e-2, warm_start_chunk=3,
                                warm_start_max_steps=3, warm_start_min_loss_drop=0.0))


@pytest.mark.parametrize("mode", ["fixed", "auto"])
def test_the_first_rl_step_after_a_warm_start_starts_adamw_afresh(tmp_path, mode):
    cfg = config(tmp_path)
    core = TrainCore.from_config(cfg)
    trainer, task = InProcess(core), load_task(cfg.task.name, cfg.task)
    tokenizer = load_tokenizer(model_dir(cfg.model))
    if mode == "fixed":
        asyncio.run(warm_start(cfg, task, trainer, tokenizer, 3))
    else:
        report = asyncio.run(auto_warm_start(cfg, task, trainer, tokenizer, NoGenerators(), NoEvalPrompts()))
        assert report.steps == 3
    warmed = {k: v.detach().clone() for k, v in core.model.state_dict().items()}
    score = lambda ids: core._scorer(core.model)(ids)  # noqa: E731  on-policy sampler logprobs
    batch = synthetic_batch(8, 24, 8, core.vocab_size, seed=1, score=score)
    core.train_step(batch)
    steps = {float(s["step"]) for s in core.optimizer.state.values()}
    assert steps == {1.0}, f"AdamW step counts after the first RL step: {sorted(steps)} (the warm start's carried over)"
    # the same step from the warm-started weights on a fresh optimizer moves every weight alike
    fresh = TrainCore.from_config(cfg)
    fresh.model.load_state_dict(warmed)
    fresh.train_step(batch)
    for (k, a), b in zip(core.model.state_dict().items(), fresh.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7, msg=k)
