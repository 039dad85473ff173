"""Pure rollout bookkeeping (pipeline/generator/trajectory.py, rewards.py): version spans, input checks,
re-prefill, pickling, stats (reward rejections and the reject window are tested in tests/test_faults.py)."""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import pytest

from pipeline.generator.rewards import RolloutStats
from pipeline.generator.trajectory import RequestError, Trajectory, check_prompt, check_request, spans_to_versions
from pipeline.types import PromptGroup, PromptItem


@dataclass
class Span:  # the shape of vllm.outputs.WeightVersionSpan
    version: str
    start: int
    end: int


def test_spans_give_each_token_the_version_that_sampled_it():
    assert spans_to_versions([Span("3", 0, 2), Span("4", 2, 5)], 5) == [3, 3, 4, 4, 4]
    assert spans_to_versions(None, 0) == []


@pytest.mark.parametrize("spans,n,msg", [
    (None, 3, "never set"),
    ([Span("1", 0, 2)], 3, "cover 2 tokens"),
    ([Span("1", 0, 1), Span("2", 2, 3)], 3, "not contiguous"),
])
def test_spans_that_do_not_cover_the_output_raise(spans, n, msg):
    with pytest.raises(RuntimeError, match=msg):
        spans_to_versions(spans, n)


@pytest.mark.parametrize("args,reason", [
    ((0, 8, 1.0, 256), "empty_prompt"),
    ((256, 8, 1.0, 256), "prompt_too_long"),
    ((5, 0, 1.0, 256), "bad_sampling_params"),
    ((5, 8, -1.0, 256), "bad_sampling_params"),
    ((5, 8, float("nan"), 256), "bad_sampling_params"),
    ((5, 8, 11.0, 256), "bad_sampling_params"),
])
def test_bad_requests_are_rejected_with_a_reason(args, reason):
    with pytest.raises(RequestError) as e:
        check_request(*args)
    assert e.value.reason == reason
    back = pickle.loads(pickle.dumps(e.value))  # crosses actor boundaries
    assert back.reason == reason and str(back) == str(e.value)


@pytest.mark.parametrize("n,reason", [(0, "empty_prompt"), (16, "prompt_too_long"), (40, "prompt_too_long")])
def test_prompts_that_leave_no_room_to_generate_are_refused_at_admission(n, reason):
    with pytest.raises(RequestError) as e:
        check_prompt(n, 16)
    assert e.value.reason == reason
    check_prompt(15, 16)  # one token of room is enough


def test_resumed_segments_count_reprefill_and_keep_old_tokens():
    t = Trajectory(PromptGroup(7, PromptItem(0, "rev ab="), 2, 0), 1, (4, 5, 6))
    t.begin_segment()
    t.extend([10, 11], [-0.5, -0.25], [0, 0])
    assert t.reprefill_tokens == 0
    t.begin_segment()  # resubmitted with prompt + 2 tokens
    assert t.reprefill_tokens == 5 and t.context() == [4, 5, 6, 10, 11]
    t.extend([12], [-1.0], [1])
    r = t.to_rollout("xyz", "length", 0.5, generator_id=3)
    assert r.completion_tokens == (10, 11, 12) and r.versions == (0, 0, 1) and r.logprobs == (-0.5, -0.25, -1.0)
    assert r.reprefill_tokens == 5 and r.generator_id == 3 and r.min_version == 0
    with pytest.raises(RuntimeError, match="2 tokens, 1 logprobs"):
        t.extend([1, 2], [0.0], [1, 1])


def test_stats_report_failures_by_reason_and_pause_times():
    s = RolloutStats()
    s.fail("empty_prompt", "g1: empty")
    s.fail("empty_prompt", "g2: empty")
    s.paused(0.5)
    s.paused(1.5)
    s.reject("reward_nan", "g3 s0: nan")
    s.accept()
    snap = s.snapshot()
    assert snap["failed"] == {"empty_prompt": 2} and snap["pause_s_mean"] == 1.0 and snap["updates"] == 2
    assert snap["rejected"] == {"reward_nan": 1} and snap["recent_samples"] == 4
    assert snap["recent_rejected_frac"] == 0.75 and snap["recent_top_reason"] == "empty_prompt"
    assert snap["recent_reasons"] == {"empty_prompt": 2, "reward_nan": 1} and snap["errors"][-1] == "g3 s0: nan"


def test_stats_snapshot_stays_bounded_over_a_long_run():
    """pause_s and reward_latency_s are windows of the last RECENT values; updates and the mean pause
    still cover the whole run."""
    from pipeline.generator.rewards import RECENT

    s = RolloutStats()
    for i in range(3 * RECENT):
        s.paused(1.0 if i < RECENT else 3.0)
        s.reward_latency_s.append(float(i))
    snap = s.snapshot()
    assert snap["updates"] == 3 * RECENT and len(snap["pause_s"]) == RECENT and set(snap["pause_s"]) == {3.0}
    assert snap["pause_s_mean"] == (1.0 + 2 * 3.0) / 3
    assert snap["reward_latency_s"] == [float(i) for i in range(2 * RECENT, 3 * RECENT)]
