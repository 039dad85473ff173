"""Guards against collapse on constructed batches: the health metrics, the collapse warning, the
entropy bonus and its adaptive coefficient, DAPO-style zero-variance filtering, the KL reference.

    .venv/bin/python -m pytest -q tests/test_health.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeline.buffer import ReplayBufferCore
from pipeline.config import BufferConfig, TrainerConfig
from pipeline.driver.health import CollapseWatch, batch_health
from pipeline.losses import adapt_entropy_coef, policy_loss, token_entropy
from pipeline.types import PromptItem

from .test_buffer import PAD, rollout


def batch_of(groups: list[list[tuple[float, int]]]):
    """A real buffer batch: one group per entry, each sample (reward, completion length)."""
    g = len(groups[0])
    buf = ReplayBufferCore(BufferConfig(group_size=g, batch_groups=len(groups), max_staleness=0,
                                        overcommit="none"), PAD)
    for samples in groups:
        gid = buf.admit(PromptItem(uid=buf.admitted_groups, prompt="p")).group_id
        for i, (r, n) in enumerate(samples):
            buf.add(rollout(gid, i, reward=r, versions=(0,) * n))
    return buf.take_batch()


def test_health_metrics_of_a_constructed_batch():
    b = batch_of([[(1.0, 3), (0.0, 1)], [(0.5, 1), (0.5, 1)], [(0.2, 4), (0.2, 2)]])
    m = batch_health(b)
    assert m["response/length_mean"] == pytest.approx((3 + 1 + 1 + 1 + 4 + 2) / 6)
    assert m["response/length_min"] == 1
    assert m["response/eos_only_frac"] == pytest.approx(3 / 6)
    assert m["groups/zero_variance_frac"] == pytest.approx(2 / 3)  # the second and third groups


def test_collapse_warning_fires_once_after_patience_and_again_on_recovery():
    w = CollapseWatch(entropy_floor=0.1, length_floor=1.5, patience=3)
    low = {"entropy": 0.01, "response/length_mean": 4.0}
    msgs = [w.update(s, dict(low)) for s in range(1, 6)]
    assert msgs[:2] == [None, None] and msgs[3:] == [None, None]
    assert "entropy 0.01 < run.collapse_entropy=0.1" in msgs[2] and "trainer.kl_coef" in msgs[2]
    row = {"entropy": 2.0, "response/length_mean": 4.0}
    assert "recovered" in w.update(6, row) and row["collapse/active"] == 0.0
    short = [w.update(s, {"entropy": 2.0, "response/length_mean": 1.0}) for s in range(7, 10)]
    assert short[2] is not None and "mean response length 1 < run.collapse_length=1.5" in short[2]
    assert w.steps_collapsed == 3 + 1  # steps 3, 4, 5 and 9


def test_collapse_watch_ignores_a_streak_that_breaks_and_floors_of_zero():
    w = CollapseWatch(entropy_floor=0.1, length_floor=0.0, patience=3)
    seq = [0.01, 0.01, 0.5, 0.01, 0.01]
    assert all(w.update(s, {"entropy": e, "response/length_mean": 0.0}) is None for s, e in enumerate(seq))
    off = CollapseWatch(0.0, 0.0, 1)
    assert off.update(1, {"entropy": 0.0, "response/length_mean": 0.0}) is None


def test_entropy_bonus_raises_the_entropy_of_a_peaked_policy():
    """Zero advantages: the bonus alone drives the update, and it flattens the distribution."""
    torch.manual_seed(0)
    logits = (torch.randn(2, 3, 11) * 4).requires_grad_(True)
    mask = torch.ones(2, 3)
    before = float(token_entropy(logits.detach()).mean())
    cfg = TrainerConfig(correction="none")
    for _ in range(50):
        logp = torch.log_softmax(logits, -1)[..., 0]
        loss, _ = policy_loss(logp, logp.detach(), logp.detach(), mask, torch.zeros(2), cfg,
                              entropy=token_entropy(logits), entropy_coef=0.5)
        logits.grad = None
        loss.backward()
        with torch.no_grad():
            logits -= 5.0 * logits.grad
    assert float(token_entropy(logits.detach()).mean()) > before + 0.5, before
    # and the coefficient 0 is exactly the plain loss
    logp = torch.log_softmax(logits, -1)[..., 0]
    plain, _ = policy_loss(logp, logp.detach(), logp.detach(), mask, torch.ones(2), cfg)
    zero, _ = policy_loss(logp, logp.detach(), logp.detach(), mask, torch.ones(2), cfg,
                          entropy=token_entropy(logits), entropy_coef=0.0)
    assert torch.equal(plain, zero)


def test_adaptive_entropy_coefficient_moves_toward_the_target_within_bounds():
    cfg = TrainerConfig(entropy_coef=0.01, entropy_target=0.5, entropy_adapt_rate=0.02, entropy_coef_max=0.03)
    assert adapt_entropy_coef(0.01, 0.2, cfg) == pytest.approx(0.01 + 0.02 * 0.3)  # under target: up
    assert adapt_entropy_coef(0.01, 1.5, cfg) == 0.0  # well over: down, floored at 0
    assert adapt_entropy_coef(0.029, 0.0, cfg) == 0.03  # capped at entropy_coef_max
    assert adapt_entropy_coef(0.01, float("nan"), cfg) == 0.01
    assert adapt_entropy_coef(0.01, 0.0, dataclasses.replace(cfg, entropy_target=0.0)) == 0.01  # fixed bonus
    with pytest.raises(ValueError, match="entropy_coef_max"):
        TrainerConfig(entropy_coef=0.1, entropy_coef_max=0.05)


def test_zero_variance_groups_are_filtered_and_replaced_by_admission():
    """DAPO dynamic sampling (buffer.zero_signal=drop): a group whose rewards are all equal never
    reaches a batch, is counted, and frees its admission slot, so the batch fills with signal."""
    buf = ReplayBufferCore(BufferConfig(group_size=2, batch_groups=2, max_staleness=0, overcommit="none",
                                        zero_signal="drop"), PAD)
    gids = [buf.admit(PromptItem(uid=i, prompt="p")).group_id for i in range(2)]
    assert not buf.can_admit()  # B groups held at staleness 0
    for i, r in enumerate((0.5, 0.5)):
        buf.add(rollout(gids[0], i, reward=r))
    assert buf.can_admit()  # the flat group was dropped: its slot is free for a new prompt
    g2 = buf.admit(PromptItem(uid=2, prompt="p")).group_id
    for gid, rs in ((gids[1], (0.0, 1.0)), (g2, (1.0, 0.25))):
        for i, r in enumerate(rs):
            buf.add(rollout(gid, i, reward=r))
    b = buf.take_batch()
    assert set(b.group_ids) == {gids[1], g2} and batch_health(b)["groups/zero_variance_frac"] == 0.0
    assert buf.zero_signal_groups == 1 and buf.dropped_groups == {"zero_signal": 1}
    buf.check_accounting()
