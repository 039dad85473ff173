"""vLLM (CPU build) loads the tiny checkpoint and generates the same greedy tokens as torchtitan."""

import json
import subprocess
import sys

import torch

from pipeline.models.hf import build_model, token_logprobs
from pipeline.tokens import load_tokenizer

from .conftest import REPO


def test_vllm_loads_tiny_checkpoint_and_agrees_with_torchtitan(tiny_dir):
    p = subprocess.run([sys.executable, str(REPO / "tests" / "vllm_generate_script.py"), str(tiny_dir)],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads(next(line for line in p.stdout.splitlines() if line.startswith("RESULT "))[7:])
    model, _ = build_model(tiny_dir)
    tok = load_tokenizer(tiny_dir)
    for prompt, r in zip(["rev abc=", "12+7="], results):
        assert len(r["ids"]) >= 1
        ids = torch.tensor([tok(prompt)["input_ids"] + r["ids"]])
        with torch.no_grad():
            logits = model(ids).float()
            lp = token_logprobs(model, ids)[0, -len(r["ids"]):]
        n = len(tok(prompt)["input_ids"])
        greedy = logits[0, n - 1: n - 1 + len(r["ids"])].argmax(-1).tolist()
        assert greedy == r["ids"], (prompt, greedy, r["ids"])
        assert torch.allclose(lp, torch.tensor(r["lp"]), atol=1e-3), (lp, r["lp"])
