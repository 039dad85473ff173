"""Generators killed mid-run (engine core, then a whole proc) are restarted and the run completes:
the short version of tools/probe/chaos.py, on the real job (CLI, Monarch, vLLM, torchtitan)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import REPO

pytestmark = pytest.mark.slow


def test_killed_generators_are_restarted_and_no_admitted_group_is_lost(tmp_path):
    out = tmp_path / "chaos"
    p = subprocess.run([sys.executable, "-m", "tools.probe.chaos", "--quick", "--out", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=1500)
    report = json.loads((out / "chaos.json").read_text()) if (out / "chaos.json").exists() else {}
    assert p.returncode == 0, p.stdout[-9000:] + p.stderr[-2000:]
    assert all(report["checks"].values()), report["checks"]
    kinds = [k["kind"] for k in report["kills"]]
    assert kinds == ["engine core", "generator proc"]
    for k in report["kills"]:
        # found by the death notice, not by a call's timeout (how fast is tools/probe/chaos.py's report, not a test)
        assert "did not answer within" not in k["cause"], k
        assert 0 <= k["detection_s"] <= k["recovery_s"], k
    assert report["buffer"]["requeued_groups"] >= 0
    assert (out / "chaos.png").stat().st_size > 0
