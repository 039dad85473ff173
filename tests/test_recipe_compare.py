"""tools/compare/recipe_compare.py's report, from synthetic metrics rows (its real runs: docs/training.md)."""

from __future__ import annotations

import json

import pytest

from .conftest import REPO

from tools.compare import recipe_compare


def rows(evals: dict[int, tuple[float, float]], steps: int, length: float, clip_high: float = 0.0) -> list[dict]:
    out = []
    for s in range(1, steps + 1):
        out.append({"step": s, "reward/mean": 0.1, "samples": 32, "response/length_mean": length + s,
                    "entropy": 0.5, "clip_low_frac": 0.0, "clip_high_frac": clip_high})
    for s, (greedy, sampled) in evals.items():
        out.append({"step": s, "eval/reward": sampled, "eval/reward_greedy": greedy, "eval/pass@k": sampled + 0.1})
    return sorted(out, key=lambda r: r["step"])


def test_seeds_are_summarised_on_their_common_eval_steps_up_to_the_budget():
    a = {"rows": rows({0: (0.1, 0.05), 5: (0.3, 0.2), 10: (0.5, 0.4), 15: (0.9, 0.9)}, 15, 20), "exit_code": 0,
         "wall_s": 100.0}
    b = {"rows": rows({0: (0.1, 0.05), 5: (0.2, 0.1), 10: (0.3, 0.2)}, 10, 30, clip_high=0.01), "exit_code": 0,
         "wall_s": 120.0}
    failed = {"rows": [], "exit_code": 1, "wall_s": 5.0}
    r = recipe_compare.summarise("dapo", [a, b, failed], steps=10)
    assert (r["runs"], r["ok"], r["exit_codes"]) == (3, 2, [0, 0, 1])
    greedy = dict(r["curve"]["greedy"])
    assert sorted(greedy) == [0, 5, 10]  # step 15 is past the budget
    assert greedy[10] == {"mean": pytest.approx(0.4), "min": 0.3, "max": 0.5, "n": 2}
    # the last three steps of each run (8..10), averaged, then over seeds
    assert r["end"]["response/length_mean"]["mean"] == pytest.approx((29 + 39) / 2)
    assert r["end"]["clip_high_frac"]["max"] == pytest.approx(0.01)
    assert "cispo_clip_frac" not in r["end"]  # a metric the recipe does not log is left out
    text = recipe_compare.table([r, recipe_compare.summarise("gspo", [failed], steps=10)])
    assert "| `dapo` | 2 | 0.100 (0.100..0.100) → 0.400 (0.300..0.500) (step 10) |" in text
    assert "| `gspo` | 1 | no finished run (exit [1])" in text


def test_a_recipe_needing_another_correction_gets_it():
    from pipeline.config import load_config

    for recipe, needs in recipe_compare.NEEDS.items():  # each loads on the real-model config
        cfg = load_config(REPO / recipe_compare.CONFIG, [f"trainer.recipe={recipe}", *needs])
        assert cfg.trainer.recipe == recipe
    with pytest.raises(Exception, match="correction"):
        load_config(REPO / recipe_compare.CONFIG, ["trainer.recipe=gspo"])  # why gspo needs geo_is here


def test_an_earlier_reports_one_run_entry_stands_in_for_that_run_exactly(tmp_path):
    run = {"rows": rows({0: (0.1, 0.05), 5: (0.3, 0.2), 10: (0.5, 0.4)}, 12, 20, clip_high=0.02), "exit_code": 0,
           "wall_s": 100.0}
    earlier = recipe_compare.summarise("dapo", [run], steps=10)
    report = tmp_path / "recipes.json"
    report.write_text(json.dumps([recipe_compare.summarise("none", [run, run], steps=10), earlier]))
    stand_in = recipe_compare.read_recorded("dapo", report)
    again = recipe_compare.summarise("dapo", [stand_in], steps=10)
    assert again["curve"] == earlier["curve"] and again["end"] == earlier["end"]
    assert again["samples_per_step"] == earlier["samples_per_step"] == 32
    # with a new seed beside it, the stand-in counts as one run of the recipe
    other = {"rows": rows({0: (0.1, 0.05), 5: (0.2, 0.1), 10: (0.3, 0.2)}, 10, 30), "exit_code": 0, "wall_s": 90.0}
    both = recipe_compare.summarise("dapo", [stand_in, other], steps=10)
    assert dict(both["curve"]["greedy"])[10] == {"mean": pytest.approx(0.4), "min": 0.3, "max": 0.5, "n": 2}
    assert both["wall_s"] == [90]  # an earlier run's wall is not mixed into this tree's
    with pytest.raises(ValueError, match="exactly one finished run"):
        recipe_compare.read_recorded("none", report)  # two runs: which one it was is lost
    with pytest.raises(ValueError, match="no metrics.jsonl"):
        recipe_compare.read_recorded("dapo", tmp_path)
    kept = tmp_path / "dapo_s11.metrics.jsonl"  # a run's metrics kept on their own
    kept.write_text("".join(json.dumps(r) + "\n" for r in run["rows"]))
    assert recipe_compare.summarise("dapo", [recipe_compare.read_recorded("dapo", kept)], steps=10)["curve"] == \
        earlier["curve"]
