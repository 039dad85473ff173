"""tools/peer_compare.py's pure parts: the settings map to TRL, the missing-extra message, the report.

TRL itself is an optional extra (pip install -e '.[peer]'); these tests do not need it and run no
trainer: the comparison's real runs are in docs/benchmarks.md ("Against TRL").
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import peer_compare  # noqa: E402
import peer_trl  # noqa: E402

from pipeline.config import load_config  # noqa: E402


def test_trl_settings_follow_the_project_config():
    cfg = load_config("configs/tiny.yaml", ["run.mode=sync"])
    kw, notes = peer_trl.trl_settings(cfg, steps=7, seed=3)
    assert (kw["per_device_train_batch_size"], kw["num_generations"], kw["gradient_accumulation_steps"]) == (64, 8, 1)
    assert (kw["learning_rate"], kw["beta"], kw["temperature"], kw["max_completion_length"]) == (3e-4, 0.05, 1.0, 8)
    assert (kw["loss_type"], kw["scale_rewards"], kw["lr_scheduler_type"], kw["max_steps"], kw["seed"]) == \
        ("dapo", "group", "constant", 7, 3)
    assert kw["use_bias_correction_kl"] is False and kw["shuffle_dataset"] is False and kw["use_vllm"] is False
    cfg = load_config("configs/tiny.yaml", ["trainer.aggregation=seq_mean", "buffer.normalize_std=false",
                                            "trainer.kl_coef=0.01", "buffer.group_size=4", "trainer.kl_estimator=k1"])
    kw, notes = peer_trl.trl_settings(cfg, steps=7, seed=3)
    assert (kw["loss_type"], kw["scale_rewards"], kw["beta"], kw["num_generations"]) == ("grpo", "none", 0.01, 4)
    kl = next(n for n in notes if n["setting"] == "KL")
    assert kl["verdict"].startswith("differs")  # k1 has no TRL counterpart: said, not hidden


def test_missing_trl_stops_before_any_run_naming_the_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(peer_trl, "trl", None)
    monkeypatch.setattr(sys, "argv", ["peer_compare.py", "--tasks", "reverse", "--seeds", "0", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"needs trl.*pip install --no-deps \"trl==1.16.\*\" accelerate"):
        peer_compare.main()
    assert not (tmp_path / "results.json").exists()


def test_report_checks_agreement_within_the_seed_spread():
    def run(final: float, samples: int = 1280) -> dict:
        return {"rows": [{"step": 0, "eval/reward": 0.1, "eval/reward_greedy": 0.3},
                         {"step": 20, "eval/reward": final, "eval/reward_greedy": final}],
                "trained_samples": samples, "wall_s": 1.0}

    close = {"runs": {f"t/{s}/{side}": run(f + (0.02 if side == "trl" else 0)) for s, f in enumerate((0.4, 0.5, 0.6))
                      for side in ("project", "trl")}}
    far = {"runs": {f"t/{s}/{side}": run(f + (0.3 if side == "trl" else 0)) for s, f in enumerate((0.4, 0.41, 0.42))
                    for side in ("project", "trl")}}
    row = peer_compare.summary(close)[0]
    assert row["agree"] and row["project"]["n"] == 3 and abs(row["diff"] + 0.02) < 1e-9
    assert not peer_compare.summary(far)[0]["agree"]
    assert "| t | sampled | (sync) | 3 / 3 |" in peer_compare.table(peer_compare.summary(close))
