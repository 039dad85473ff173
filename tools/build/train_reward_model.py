"""Train a tiny reward model (a scalar-head scorer) from a task's demonstrations.

    python -m tools.build.train_reward_model --task pipeline.tasks.reverse --out outputs/rm_reverse
    python -m pipeline.run --config configs/tiny.yaml reward_model.path=outputs/rm_reverse

The scorer starts from the policy's checkpoint (model_dir of --config's model: its body, a fresh
head; pipeline.reward_model.init_scorer) and regresses the task's reward() of completions made by
corrupting each prompt's demonstration: the demonstration itself, character substitutions,
deletions, insertions, swaps, truncations, shuffles and random strings. Every sequence is laid out
as the generators send it (prompt tokens, completion tokens, EOS), so the scorer reads the same
tokens in a run. It prints progress, then the held-out mean squared error and the correlation of
score and reward, and writes them with the checkpoint (rm_train.json).

A task needs `demonstration(item)` (a single-turn one) for this tool; a real reward model is any HF
*ForSequenceClassification checkpoint with num_labels=1 and the policy's tokenizer.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from pipeline.config import load_config
from pipeline.models.hf import model_dir
from pipeline.reward_model import StreamingScorer, init_scorer
from pipeline.tasks import PromptStream, load_task
from pipeline.tokens import SpecialTokens, encode_completion, encode_prompt, load_tokenizer


def corrupt(demo: str, alphabet: str, rng: random.Random) -> str:
    """A completion near or far from the demonstration."""
    s = list(demo)
    kind = rng.randrange(8)
    if kind == 0 or not s:
        return demo if kind == 0 else "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))
    n = rng.randint(1, max(1, len(s)))
    for _ in range(n if kind in (1, 2, 3) else 1):
        if kind == 1 and s:  # substitute
            s[rng.randrange(len(s))] = rng.choice(alphabet)
        elif kind == 2 and s:  # delete
            del s[rng.randrange(len(s))]
        elif kind == 3:  # insert
            s.insert(rng.randrange(len(s) + 1), rng.choice(alphabet))
    if kind == 4 and len(s) > 1:  # swap two
        i, j = rng.sample(range(len(s)), 2)
        s[i], s[j] = s[j], s[i]
    elif kind == 5:  # truncate
        s = s[:rng.randrange(len(s))]
    elif kind == 6:  # shuffle
        rng.shuffle(s)
    elif kind == 7:  # random of a similar length
        s = [rng.choice(alphabet) for _ in range(max(1, len(s) + rng.randint(-2, 2)))]
    return "".join(s)


def make_data(task, tok, seed: int, split: str, n: int, enable_thinking: bool | None = None
              ) -> list[tuple[list[int], float]]:
    """Scored sequences laid out as the generators lay out a rollout: the prompt as they tokenise it
    (pipeline.tokens.encode_prompt), the completion, the end of the model's turn (SpecialTokens.end_of_turn)."""
    rng = random.Random(seed)
    special = SpecialTokens.of(tok)
    stream = PromptStream(task, seed, split)
    out = []
    while len(out) < n:
        item = next(stream)
        demo = task.demonstration(item)
        if not isinstance(demo, str):
            raise SystemExit(f"{task.name}: demonstration() returned a {type(demo).__name__}; this tool needs "
                             "a single-turn task (a str demonstration)")
        alphabet = "".join(sorted(set(demo + (item.prompt if isinstance(item.prompt, str) else "")))) or "ab"
        for _ in range(4):
            c = corrupt(demo, alphabet, rng)
            ids = encode_prompt(tok, item.prompt, enable_thinking) + encode_completion(tok, c) + [special.end_of_turn(item.prompt)]
            out.append((ids, float(task.reward(item.prompt, c))))
    return out


def batches(data, size: int, rng: random.Random):
    while True:
        rng.shuffle(data)
        for i in range(0, len(data) - size + 1, size):
            yield data[i:i + size]


def forward(model, rows) -> torch.Tensor:
    n = max(len(r[0]) for r in rows)
    ids = torch.zeros((len(rows), n), dtype=torch.long)  # padding is masked out: any id does
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, (s, _) in enumerate(rows):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    body = getattr(model, model.base_model_prefix)
    h = body(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    last = h[torch.arange(len(rows)), mask.sum(1) - 1]
    return model.score(last)[:, 0]


def evaluate(hf_dir: Path, data) -> dict:
    scorer = StreamingScorer(hf_dir)
    scores = scorer.score([d[0] for d in data])
    rewards = [d[1] for d in data]
    mse = statistics.fmean((a - b) ** 2 for a, b in zip(scores, rewards))
    corr = statistics.correlation(scores, rewards) if len(set(rewards)) > 1 else float("nan")
    return {"mse": mse, "corr": corr, "reward_mean": statistics.fmean(rewards), "n": len(data)}


def train(task_name: str, out: Path, config: str | None = None, steps: int = 2000, batch: int = 64,
          lr: float = 1e-3, examples: int = 8000, seed: int = 0, log_every: int = 100) -> dict:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    cfg = load_config(config)
    policy = model_dir(cfg.model)
    task = load_task(task_name, cfg.task)
    if task.demonstration is None:
        raise SystemExit(f"{task_name} has no demonstration(); this tool trains from demonstrations")
    tok = load_tokenizer(policy)
    train_data = make_data(task, tok, seed, "train", examples, cfg.task.enable_thinking)
    held = make_data(task, tok, seed + 1, "eval", 512, cfg.task.enable_thinking)
    init_scorer(policy, out, seed)
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    t0 = time.monotonic()
    it = batches(train_data, batch, rng)
    for step in range(1, steps + 1):
        rows = next(it)
        target = torch.tensor([r[1] for r in rows])
        loss = torch.nn.functional.mse_loss(forward(model, rows), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % log_every == 0 or step == steps:
            print(f"step {step}/{steps} mse {loss.item():.4f} ({time.monotonic() - t0:.0f}s)", flush=True)
    model.save_pretrained(out)
    report = {"task": task_name, "steps": steps, "examples": len(train_data), "train_s": time.monotonic() - t0,
              "held_out": evaluate(out, held)}
    (out / "rm_train.json").write_text(json.dumps(report, indent=2))
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="pipeline.tasks.reverse")
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default="configs/tiny.yaml", help="whose model (and its tokenizer) the scorer starts from")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--examples", type=int, default=8000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    r = train(a.task, Path(a.out), a.config, a.steps, a.batch, a.lr, a.examples, a.seed)
    h = r["held_out"]
    print(f"held-out: mse {h['mse']:.4f}, corr(score, reward) {h['corr']:.3f} over {h['n']} sequences "
          f"(reward mean {h['reward_mean']:.3f}); checkpoint {a.out}")


if __name__ == "__main__":
    main()
