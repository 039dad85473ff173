"""The first RL steps after a warm start, with AdamW's moments carried over from the supervised steps
or dropped (pipeline/driver/warm_start.py hand_over): each step's update norm and its alignment with
the warm start's last update. One in-process TrainCore of the tiny model, configs/tiny.yaml's trainer
(trainer.lr 3e-4, run.warm_start_lr 1e-3, KL 0.05, tis), no mesh.

    python -m tools.compare.warm_start_moments                      # 3 seeds, 20 warm-start steps, 5 RL steps
    python -m tools.compare.warm_start_moments --seeds 1 --warm 10 --rl 3

Per seed: `--warm` supervised steps on the reverse task's demonstrations (a batch of
buffer.batch_groups x group_size = 64, as the warm start takes them), then the core is copied and
both copies take the same `--rl` RL steps, one with the warm start's AdamW state (`carried`), one
after `state.reset_optimizer()` (`reset`). The RL batches are synthetic (pipeline/trainer/synthetic.py:
64 rows of 16 prompt + 8 completion tokens, random advantages, sampler logprobs the warm-started
policy's own plus noise 0.1), made once per seed from the warm-started weights, so both arms see the
same ones. Prints, per arm and RL step, |Δθ| (the L2 norm of the step's change over every trained
weight), |Δθ| / (lr·sqrt(n)) (1 for a step that moves every weight by lr, AdamW's first step), and
cos(Δθ, the last warm-start update); writes the rows as JSON to --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
from pathlib import Path

import torch

from pipeline.config import load_config
from pipeline.driver.warm_start import demo_batch
from pipeline.models.hf import model_dir
from pipeline.tasks import PromptStream, load_task
from pipeline.tokens import load_tokenizer
from pipeline.trainer.step import TrainCore
from pipeline.trainer.synthetic import synthetic_batch
from tools.lib.cli import REPO



def flat(core: TrainCore) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in core.model.parameters() if p.requires_grad])


def run_seed(seed: int, warm: int, rl: int) -> dict[str, list[dict]]:
    cfg = load_config(REPO / "configs" / "tiny.yaml", [f"run.seed={seed}", f"task.seed={seed}",
                                                       "run.out_dir=/tmp/warm_start_moments"])
    core = TrainCore.from_config(cfg)
    task, tok = load_task(cfg.task.name, cfg.task), load_tokenizer(model_dir(cfg.model))
    items, n = PromptStream(task, cfg.task.seed + 7919), cfg.buffer.batch_groups * cfg.buffer.group_size
    last = None
    for _ in range(warm):
        before = flat(core)
        ids, mask = demo_batch(tok, task, [next(items) for _ in range(n)])
        core.sft_step(ids, mask, cfg.run.warm_start_lr)
        last = flat(core) - before
    if core.ref_model is not None:
        core.state.set_reference()
    score = core._scorer(core.model)
    batches = [synthetic_batch(n, 24, 16, core.vocab_size, seed=1000 * seed + k, score=score) for k in range(rl)]
    arms = {"carried": copy.deepcopy(core), "reset": copy.deepcopy(core)}
    arms["reset"].state.reset_optimizer()
    out: dict[str, list[dict]] = {}
    for name, c in arms.items():
        rows = []
        for k, b in enumerate(batches):
            before = flat(c)
            m = c.train_step(b)
            d = flat(c) - before
            rows.append({"step": k + 1, "update_norm": float(d.norm()),
                         "update_per_lr_sqrt_n": float(d.norm()) / (m["lr"] * math.sqrt(d.numel())),
                         "cos_last_warm_update": float(torch.nn.functional.cosine_similarity(d, last, dim=0)),
                         "grad_norm": m["grad_norm"], "lr": m["lr"]})
        out[name] = rows
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--warm", type=int, default=20)
    ap.add_argument("--rl", type=int, default=5)
    ap.add_argument("--out", default="outputs/warm_start_moments.json")
    a = ap.parse_args()
    runs = {s: run_seed(s, a.warm, a.rl) for s in range(1, a.seeds + 1)}
    print(f"{a.warm} warm-start steps, then {a.rl} RL steps; mean over {a.seeds} seed(s) (min..max)")
    print("arm     step  |Δθ|                      |Δθ|/(lr·√n)           cos(Δθ, last warm update)")
    for arm in ("carried", "reset"):
        for k in range(a.rl):
            cells = []
            for key in ("update_norm", "update_per_lr_sqrt_n", "cos_last_warm_update"):
                v = [runs[s][arm][k][key] for s in runs]
                cells.append(f"{statistics.fmean(v):.4g} ({min(v):.3g}..{max(v):.3g})".ljust(26))
            print(f"{arm:8s}{k + 1:4d}  " + "".join(cells))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
