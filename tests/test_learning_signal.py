"""The learning-signal rules (pipeline/driver/learning_signal.py): the probe's figures, the auto warm
start's stopping rule, the zero-signal alarm's windowing, the pre-flight line, buffer.zero_signal=auto's
choice and the SignalAlarm hook that applies it to the buffer; and one short CLI
run on a task whose reward is constant, which the alarm warns about and run.stop_without_signal ends
with exit code 3 and its own summary.

    .venv/bin/python -m pytest -q tests/test_learning_signal.py
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from math import comb
from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.driver.learning_signal import (Probe, RunFacts, SignalWatch, StepSignal, WarmStartRule, dynamic_sampling,
                                             preflight, spread_chance)
from pipeline.run import NO_SIGNAL_EXIT
from pipeline.tasks import reverse

REPO = Path(__file__).resolve().parents[1]
RULE = WarmStartRule(signal=0.5, pass_min=0.1, pass_max=0.9, min_loss_drop=0.03, max_steps=100)


def test_spread_chance_is_the_exact_share_of_g_subsets_with_unequal_rewards():
    r = [0.0, 0.0, 0.0, 1.0, 1.0, 0.5]
    assert spread_chance(r, 2) == pytest.approx(1 - (comb(3, 2) + comb(2, 2)) / comb(6, 2))
    assert spread_chance([0.3] * 4, 4) == 0.0 and spread_chance([0.3, 0.3, 0.3, 0.4], 4) == 1.0
    with pytest.raises(ValueError):
        spread_chance([0.0, 1.0], 3)


def test_probe_figures_and_prompts_short_of_k_samples_left_out():
    p = Probe.of([[0, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0]], k=4)  # the last: 2 usable samples < k
    assert p.prompts == 3 and p.binary
    assert p.spread == pytest.approx(1 / 3) and p.pass_at_k == pytest.approx(2 / 3)
    assert p.pass_rate == pytest.approx(6 / 12) and p.mean_reward == pytest.approx(0.5)
    assert not Probe.of([[0.5, 0.0]], k=2).binary
    assert Probe.of([[1.0]], k=2).prompts == 0


def test_warm_start_rule_stops_on_signal_and_for_a_0_1_reward_only_inside_the_band():
    partial = Probe.of([[0.1, 0.0, 0.0, 0.0]] * 6 + [[0.0] * 4] * 4, k=4)  # 0.6 with a spread, not 0/1
    assert RULE.decide(0, partial, []) == "0.60 of held-out groups have a reward spread (target 0.5)"
    rare = Probe.of([[1, 1, 0, 0, 0, 0, 0, 0, 0, 0]] * 10, k=4)  # 2 of 10 solved: 2/3 of groups of 4 spread
    assert rare.spread == pytest.approx(1 - comb(8, 4) / comb(10, 4))
    assert RULE.decide(10, rare, [2.0]).endswith("(target 0.5), pass rate 0.20 in 0.1..0.9")
    rarer = Probe.of([[1] + [0] * 19] * 10, k=4)  # a spread in 20% of groups, pass rate 0.05: go on
    assert RULE.decide(10, rarer, [2.0]) is None
    band = WarmStartRule(signal=0.1, pass_min=0.1, pass_max=0.9, min_loss_drop=0.0, max_steps=100)
    assert band.decide(10, rarer, [2.0]) is None  # spread enough, but the pass rate is below the band
    solved = Probe.of([[1] * 19 + [0]] * 10, k=4)  # pass rate 0.95
    assert "above run.warm_start_pass_max=0.9" in RULE.decide(20, solved, [2.0, 1.0])


def test_warm_start_rule_stops_when_the_loss_stops_falling_or_at_the_cap():
    flat = Probe.of([[0.0] * 4] * 8, k=4)
    assert RULE.decide(0, flat, []) is None
    assert RULE.decide(20, flat, [2.0, 1.5]) is None  # -25%
    why = RULE.decide(30, flat, [2.0, 1.5, 1.48])
    assert why.startswith("the demonstration loss stopped falling (1.5000 -> 1.4800, 1.3% < run.warm_start_min_loss_drop=0.03")
    assert RULE.decide(100, flat, [2.0, 1.0]) == "run.warm_start_max_steps=100 reached"
    assert RULE.decide(100, None, [2.0, 1.0]) == "run.warm_start_max_steps=100 reached"  # no held-out probe
    assert WarmStartRule(0.5, 0.1, 0.9, 0.0, 100).decide(30, flat, [2.0, 2.0, 2.0]) is None  # 0: loss never stops it


def flat_step(share: float, values=(0.0,), entropy: float = 1.5) -> StepSignal:
    return StepSignal(share, tuple(values), 0.0, 0.0, entropy)


def test_alarm_warns_once_after_patience_steps_in_a_row_and_a_signal_step_resets_the_streak():
    w = SignalWatch(share=0.9, patience=3, stop_after=0)
    seq = [1.0, 1.0, 0.5, 1.0, 1.0, 0.95, 1.0, 1.0, 1.0]
    events = [w.update(s, flat_step(x)) for s, x in enumerate(seq, 1)]
    assert [e[0] if e else None for e in events] == [None] * 5 + ["warn"] + [None] * 3  # step 6: third in a row
    assert "no learning signal: 3 steps in a row with at least 0.9" in events[5][1]
    assert "run.stop_without_signal" not in events[5][1]  # 0: the run does not stop


def test_alarm_names_the_knobs_of_each_cause_and_stops_after_stop_after():
    w = SignalWatch(share=0.9, patience=2, stop_after=4)
    events = [w.update(1, flat_step(1.0, (0.0, 0.0))), w.update(2, flat_step(1.0, (1.0, 0.0)))]
    assert events[0] is None and events[1][0] == "warn"
    msg = events[1][1]
    assert "75% of these groups were never solved" in msg and "run.warm_start_max_steps" in msg
    assert "25% of these groups were always solved" in msg and "buffer.zero_signal=drop" in msg
    assert "stops after run.stop_without_signal=4" in msg
    assert w.update(3, flat_step(1.0, (0.4, 0.4), entropy=0.01)) is None  # warned once
    kind, msg = w.update(4, flat_step(1.0, (0.4,), entropy=0.01))
    assert kind == "stop" and msg.startswith("step 4: stopping early (run.stop_without_signal=4)")
    assert "equal partial rewards" in msg and "trainer.entropy_target" in msg and "entropy 0.01" in msg


def test_step_signal_counts_dropped_groups_without_signal():
    m = {"groups/zero_variance_frac": 0.25, "reward/mean": 0.5, "entropy": 1.0}
    assert StepSignal.of(m, [0.0], batch_groups=4, dropped_flat=0, pass_rate=0.0).flat_share == 0.25
    # buffer.zero_signal=drop: a batch of 4 groups with signal, 12 flat ones dropped meanwhile
    assert StepSignal.of({**m, "groups/zero_variance_frac": 0.0}, [], 4, 12, 0.0).flat_share == 0.75


def test_preflight_line_says_what_the_probe_implies_for_grpo():
    line, bad = preflight(Probe.of([[1, 0, 0, 0, 0, 0, 0, 0]] + [[0] * 8] * 31, k=8))
    assert bad and line.startswith("pre-flight: held-out pass@8 = 0.03") and "rarely solves" in line
    assert "run.warm_start_max_steps" in line
    line, bad = preflight(Probe.of([[1] * 8] * 10, k=8))
    assert bad and "solves nearly every prompt" in line and "harder prompts" in line
    line, bad = preflight(Probe.of([[1, 0] * 4] * 10, k=8))
    assert not bad and "carry a learning signal" in line


SPREAD_0125 = Probe.of([[1, 0, 0, 0, 0, 0, 0, 0]] + [[0] * 8] * 7, k=8)  # 1 of 8 prompts has a spread
SPREAD_06 = Probe.of([[1, 0, 0, 0]] * 6 + [[0] * 4] * 4, k=4)  # 6 of 10
AUTO = RunFacts(zero_signal="auto", steps=100, patience=20)


def test_auto_drops_flat_groups_only_when_under_half_of_held_out_groups_have_a_spread():
    assert SPREAD_0125.spread == pytest.approx(0.125) and SPREAD_06.spread == pytest.approx(0.6)
    on, why = dynamic_sampling(SPREAD_0125, AUTO)
    assert on and why == "buffer.zero_signal=auto, 0.12 of held-out groups have a reward spread, under 0.5"
    assert dynamic_sampling(SPREAD_06, AUTO) == (
        False, "buffer.zero_signal=auto, 0.60 of held-out groups have a reward spread, at least 0.5")
    on, why = dynamic_sampling(SPREAD_0125, RunFacts(zero_signal="auto", teacher=True))
    assert not on and "per-token distillation gives every group a signal" in why
    on, why = dynamic_sampling(Probe.of([[0.0] * 8] * 8, k=8), AUTO)  # no spread at all: drop would starve
    assert not on and "starve the batches" in why
    assert dynamic_sampling(None, AUTO) == (False, "buffer.zero_signal=auto without a pre-flight probe")
    assert dynamic_sampling(Probe.of([[1.0]], k=8), AUTO)[0] is False  # no prompt with k samples
    assert dynamic_sampling(SPREAD_06, RunFacts(zero_signal="drop")) == (True, "buffer.zero_signal=drop")
    assert dynamic_sampling(SPREAD_0125, RunFacts(zero_signal="keep")) == (False, "buffer.zero_signal=keep")


def test_run_facts_see_a_teacher_only_when_distillation_is_on():
    facts = RunFacts.of(load_config(None), warm_steps=3)
    assert facts == RunFacts(zero_signal="auto", teacher=False, warm_steps=3, steps=20, patience=20)
    assert RunFacts.of(load_config(None, ["teacher.hf_dir=self", "trainer.recipe=opd"]), 0).teacher
    assert not RunFacts.of(load_config(None, ["teacher.hf_dir=self"]), 0).teacher  # distill_coef 0: unused


def test_preflight_warning_under_half_gives_the_numbers_the_choice_and_the_levers():
    line, bad = preflight(SPREAD_0125, AUTO)
    assert bad and line.startswith("pre-flight: held-out pass@8 = 0.12, mean reward 0.016, 0.12 of groups of 8 "
                                   "have a reward spread, pass rate 0.016: ")
    assert "rarely solves a prompt in 8 tries" in line
    assert "dynamic sampling on (buffer.zero_signal=auto, 0.12 of held-out groups have a reward spread, under 0.5)" in line
    assert "a teacher (trainer.recipe=opd or opd+grpo with teacher.hf_dir=<dir>)" in line
    assert "teacher.hf_dir=self teacher.context='The correct final answer is {answer}.'" in line
    assert "run.warm_start_steps=auto" in line and "task.solution_column" in line
    assert "zero-signal alarm" not in line  # 100 steps: long enough
    # with a teacher: dynamic sampling stays off, and a teacher is no longer a lever
    line, bad = preflight(SPREAD_0125, RunFacts(zero_signal="auto", teacher=True, warm_steps=10))
    assert bad and "dynamic sampling off (buffer.zero_signal=auto with a teacher" in line
    assert "teacher.hf_dir=<dir>" not in line and "teacher.hf_dir=self" not in line
    assert "a longer warm start" in line and "task.solution_column" not in line  # a warm start ran
    # keep set by hand: a warning all the same, with dynamic sampling as a lever
    line, bad = preflight(SPREAD_0125, RunFacts(zero_signal="keep"))
    assert bad and "dynamic sampling off (buffer.zero_signal=keep)" in line and "buffer.zero_signal=auto or drop" in line
    # at least half: the line of before, at info level, with auto's choice
    line, bad = preflight(SPREAD_06, AUTO)
    assert not bad and line.endswith("most groups carry a learning signal for GRPO (dynamic sampling off: "
                                     "buffer.zero_signal=auto, 0.60 of held-out groups have a reward spread, at least 0.5)")


def test_preflight_warns_that_a_short_run_may_end_before_the_zero_signal_alarm():
    line, _ = preflight(SPREAD_0125, RunFacts(zero_signal="auto", steps=10, patience=20))
    assert line.endswith("run.steps=10 is below run.no_signal_patience=20: the run ends before the zero-signal "
                         "alarm can fire")
    line, _ = preflight(SPREAD_0125, RunFacts(zero_signal="auto", steps=15, patience=5))
    assert "run.steps=15 is a short run: it may end before the zero-signal alarm (run.no_signal_patience=5" in line
    line, bad = preflight(SPREAD_06, RunFacts(zero_signal="auto", steps=5, patience=20))
    assert not bad and "zero-signal alarm" not in line  # signal enough: nothing to warn about


class _Buffer:
    """Stands in for the ReplayBufferActor's mesh (its endpoint runs on real Monarch procs in
    tests/test_replay_buffer_actor.py): `set_zero_signal` and `stats` on a real ReplayBufferCore."""

    def __init__(self, cfg):
        from pipeline.buffer import ReplayBufferCore

        self.core = ReplayBufferCore(cfg.buffer, 0)
        core = self.core

        class _Endpoint:
            def __init__(self, fn):
                self.fn = fn

            async def call_one(self, *args):
                return self.fn(*args)

        self.set_zero_signal = _Endpoint(lambda mode: (core.set_zero_signal(mode), core.zero_signal_mode)[1])
        self.stats = _Endpoint(core.stats)


class _Evaluation:
    """Stands in for the held-out evaluation (which needs a vLLM engine): fixed per-prompt rewards."""

    def __init__(self, per_prompt):
        self.per_prompt = per_prompt

    async def probe(self, g, reuse, n):
        return self.per_prompt


def _alarm(per_prompt, *overrides):
    import types

    from pipeline.driver.hooks import SignalAlarm

    cfg = load_config(None, ["task.eval_prompts=8", "run.eval_every=5", *overrides])
    job = types.SimpleNamespace(cfg=cfg, warm=None, buffer=_Buffer(cfg), evaluation=_Evaluation(per_prompt))
    return SignalAlarm(job, sink=None), job


@pytest.mark.parametrize("per_prompt, k, overrides, on", [
    ([[1, 0, 0, 0, 0, 0, 0, 0]] + [[0] * 8] * 7, 8, [], True),            # 0.125: dynamic sampling on
    ([[1, 0, 0, 0]] * 6 + [[0] * 4] * 4, 4, [], False),                    # 0.6: off
    ([[1, 0, 0, 0, 0, 0, 0, 0]] + [[0] * 8] * 7, 8, ["teacher.hf_dir=self", "trainer.recipe=opd"], False),
    ([[1, 0, 0, 0, 0, 0, 0, 0]] + [[0] * 8] * 7, 8, ["buffer.zero_signal=keep"], False),
])
def test_signal_alarm_start_switches_the_buffer_and_records_the_choice(per_prompt, k, overrides, on, caplog):
    alarm, job = _alarm(per_prompt, f"buffer.group_size={k}", *overrides)
    row0: dict = {}
    with caplog.at_level(logging.INFO, logger="pipeline.driver.hooks"):
        asyncio.run(alarm.start(1, row0))
    assert job.buffer.core.zero_signal_mode == ("drop" if on else "keep")
    assert row0["preflight/dynamic_sampling"] == float(on) and "preflight/spread_share" in row0
    summary = asyncio.run(alarm.finish(1, "steps"))["zero_signal"]
    assert summary["dynamic_sampling"] is on and summary["setting"] == job.cfg.buffer.zero_signal
    (rec,) = [r for r in caplog.records if "pre-flight:" in r.getMessage()]
    assert rec.levelno == (logging.INFO if k == 4 else logging.WARNING)  # a warning under half, whatever chose


def test_signal_alarm_without_a_probe_keeps_and_says_so_at_info_level(caplog):
    alarm, job = _alarm([], "task.eval_prompts=0")
    row0: dict = {}
    with caplog.at_level(logging.INFO, logger="pipeline.driver.hooks"):
        asyncio.run(alarm.start(1, row0))
    assert row0 == {} and job.buffer.core.zero_signal_mode == "keep"
    (rec,) = caplog.records
    assert rec.levelno == logging.INFO and "no held-out probe (run.eval_every=5, task.eval_prompts=0)" in rec.getMessage()
    assert asyncio.run(alarm.finish(0, "steps"))["zero_signal"] == {
        "setting": "auto", "dynamic_sampling": False, "why": "buffer.zero_signal=auto without a pre-flight probe"}
    # a resumed run: no probe; the buffer's checkpoint holds the fresh run's choice
    alarm, job = _alarm([])
    job.buffer.core.set_zero_signal("drop")  # as load_state_dict restores it
    asyncio.run(alarm.start(7, row0))
    assert row0 == {} and asyncio.run(alarm.finish(7, "steps"))["zero_signal"]["dynamic_sampling"] is True


def test_warm_start_keys_are_checked():
    assert load_config(None).run.warm_start_steps == "auto"
    assert load_config(None, ["run.warm_start_steps=15"]).run.warm_start_steps == 15
    for bad, key in [("run.warm_start_steps=soon", "run.warm_start_steps"), ("run.warm_start_steps=-1", "run.warm_start_steps"),
                     ("run.warm_start_chunk=0", "run.warm_start_chunk"), ("run.warm_start_signal=0", "run.warm_start_signal"),
                     ("run.warm_start_pass_max=0.05", "run.warm_start_pass_max"),
                     ("run.warm_start_min_loss_drop=1", "run.warm_start_min_loss_drop"),
                     ("run.stop_without_signal=-1", "run.stop_without_signal"), ("run.no_signal_patience=0", "run.no_signal_patience")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, [bad])


# ---------------------------------------------------------------------- a real run


def prompts(seed: int, split: str):
    return reverse.prompts(seed, split)


def reward(prompt: str, completion: str) -> float:
    """Constant: no group ever has a reward spread."""
    return 0.0


def test_a_run_without_signal_warns_and_stops_early_with_its_exit_code(tmp_path):
    """A task whose reward is constant: every group is flat. The pre-flight line says so, the alarm
    warns at step 2, run.stop_without_signal=3 ends the run after step 3 (not run.steps=40) the
    clean way: a final eval, the last checkpoint, the HF export, summary.json with `ended`, exit 3."""
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "pipeline.run", "--config", "configs/tiny.yaml", f"task.name={__name__}",
                        "run.steps=40", "run.warm_start_steps=auto", "run.no_signal_patience=2", "run.stop_without_signal=3", "run.eval_every=100",
                        "task.eval_prompts=8", "run.checkpoint_every=2", "run.progress=false", "buffer.batch_groups=2",
                        "buffer.group_size=2", "generator.concurrency=4", "generator.max_new_tokens=6",
                        f"run.out_dir={out}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == NO_SIGNAL_EXIT == 3, p.stdout[-2000:] + p.stderr[-4000:]
    assert "step 2: no learning signal: 2 steps in a row" in p.stderr
    assert "pre-flight: held-out pass@2 = 0.00, mean reward 0.000, 0.00 of groups" in p.stderr
    assert "== done: 3 steps" in p.stdout and "stopped early, exit code 3: step 3: stopping early" in p.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ended"] == "no_signal" and summary["steps"] == 3
    assert summary["warm_start"]["steps"] == 0 and "has no demonstration()" in summary["warm_start"]["reason"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["signal/flat_share"] for r in rows if "signal/flat_share" in r] == [1.0, 1.0, 1.0]
    assert [r["step"] for r in rows if "eval/reward" in r] == [0, 3]  # step 0 and the final model
    assert (out / "checkpoints" / "step_2").is_dir() and (out / "hf_checkpoint" / "config.json").is_file()


def test_auto_warm_start_stops_on_its_rule_and_the_generators_serve_its_weights(tmp_path):
    """run.warm_start_steps=auto on `reverse`: chunks of 5 steps, each followed by a held-out probe
    of groups of 4 on the generators, which reload each chunk's export (under version 0). It stops
    on a stated reason at a chunk boundary; the probes move with the weights (the reload took)."""
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "pipeline.run", "--config", "configs/tiny.yaml", "run.steps=1",
                        "run.warm_start_steps=auto", "run.warm_start_chunk=5", "run.warm_start_max_steps=20",
                        "run.eval_every=1", "task.eval_prompts=16", "run.checkpoint_every=0", "run.progress=false",
                        "buffer.batch_groups=2", "buffer.group_size=4", "generator.concurrency=8",
                        f"run.out_dir={out}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    warm = json.loads((out / "summary.json").read_text())["warm_start"]
    assert warm["mode"] == "auto" and warm["steps"] in (0, 5, 10, 15, 20) and warm["reason"], warm
    assert f"warm start (auto): {warm['steps']} supervised steps" in p.stdout and warm["reason"] in p.stdout
    if warm["steps"]:
        assert warm["after"]["mean_reward"] > warm["before"]["mean_reward"] + 0.02, warm
    row = next(json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "preflight/spread_share" in line)
    assert row["warm_start/steps"] == warm["steps"] and row["preflight/spread_share"] == warm["after"]["spread"]
