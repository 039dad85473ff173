"""The peer side of tools/peer_compare.py: TRL's GRPOTrainer on this project's task and settings.

    ev = HFEval(cfg, task)                                   # the task's held-out prompts, as pipeline/driver/evaluation.py
    ev.evaluate(model, tokenizer, seed=0)                    # {"eval/reward": ..., "eval/reward_greedy": ...}
    kwargs, notes = trl_settings(cfg, steps=200, seed=0)     # GRPOConfig keyword arguments, and how each maps
    rows = run_trl(cfg, task, warm_dir, seed=0, steps=200, eval_every=25, out=Path("bench_out/x"))

TRL is an optional extra (`pip install --no-deps "trl==1.16.*" "accelerate"`, or `pip install -e '.[peer]'`):
it is imported here only if present, and `require_trl` says how to install it. TRL generates with
HF transformers' `generate` on CPU (no vLLM: `use_vllm=False`), so its sampler and learner are the
same model and every step is exactly on-policy. `HFEval` scores a model the way the project's eval
does (task.eval_prompts held-out prompts, task.eval_samples samples each at generator.temperature
plus one greedy completion, generator.max_new_tokens, the task's reward, rejected rewards left out),
with HF `generate`, so it scores TRL's policy and, as a cross-check, the project's exports too.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback

from pipeline.config import Config
from pipeline.tasks import RewardRejected, Task, take
from pipeline.tokens import SpecialTokens, encode_prompt

try:  # optional extras: peer_compare's project side and its report run without them
    import trl
except ImportError:
    trl = None
try:
    import accelerate
except ImportError:
    accelerate = None

INSTALL = 'pip install --no-deps "trl==1.16.*" accelerate   (or: pip install -e ".[peer]")'


def require_trl() -> None:
    """Raise SystemExit with the install command when TRL (or accelerate, which its trainer needs) is missing."""
    missing = [name for name, mod in (("trl", trl), ("accelerate", accelerate)) if mod is None]
    if missing:
        raise SystemExit(f"peer_compare: the TRL side needs {' and '.join(missing)}, which "
                         f"{'is' if len(missing) == 1 else 'are'} not installed. Install the optional extra: {INSTALL}")


def check_task(task: Task, cfg: Config) -> None:
    """The comparison covers single-turn tasks with str prompts: TRL renders chat prompts with its own
    template call and runs tools its own way, so those would not be the same prompts."""
    if task.env is not None:
        raise SystemExit(f"peer_compare: task {task.name} is multi-turn (an env); the TRL side compares single-turn tasks")
    first = take(task, cfg.task.seed, "train", 1)
    if first and not isinstance(first[0].prompt, str):
        raise SystemExit(f"peer_compare: task {task.name} has chat prompts; the TRL side compares str prompts only")


class HFEval:
    """Held-out eval with HF `generate` (contract in the module docstring). Seeded per call and run
    under `torch.random.fork_rng`, so evaluating never moves the training run's random stream.

    Example:
        ev = HFEval(cfg, task)
        model = AutoModelForCausalLM.from_pretrained(warm_dir); tok = AutoTokenizer.from_pretrained(warm_dir)
        print(ev.evaluate(model, tok, seed=0)["eval/reward"])
    """

    def __init__(self, cfg: Config, task: Task):
        self.cfg, self.task = cfg, task
        self.items = take(task, cfg.task.seed, "eval", cfg.task.eval_prompts)

    def _generate(self, model, tok, ids: list[list[int]], sample: bool) -> list[str]:
        special = SpecialTokens.of(tok)
        t = max(map(len, ids))  # left padding: generation continues every row from its last prompt token
        inp = torch.tensor([[special.pad] * (t - len(x)) + x for x in ids])
        att = torch.tensor([[0] * (t - len(x)) + [1] * len(x) for x in ids])
        kw = dict(do_sample=True, temperature=self.cfg.generator.temperature, top_k=0, top_p=1.0) if sample else \
            dict(do_sample=False)
        out = model.generate(input_ids=inp, attention_mask=att, max_new_tokens=self.cfg.generator.max_new_tokens,
                             pad_token_id=special.pad, eos_token_id=sorted(special.stop), **kw)
        texts = []
        for row in out[:, t:].tolist():
            cut = next((k for k, x in enumerate(row) if x in special.stop), len(row))  # the turn ends at eos
            texts.append(tok.decode(row[:cut], skip_special_tokens=True))
        return texts

    def evaluate(self, model, tok, seed: int) -> dict[str, float]:
        n = self.cfg.task.eval_samples
        ids = [encode_prompt(tok, it.prompt) for it in self.items]
        was_training = model.training
        model.eval()
        with torch.no_grad(), torch.random.fork_rng():
            torch.manual_seed(seed)
            greedy = self._generate(model, tok, ids, sample=False)
            sampled = self._generate(model, tok, ids * n, sample=True)
        model.train(was_training)
        prompts = [it.prompt for it in self.items]
        return {"eval/reward": self._mean(prompts * n, sampled), "eval/reward_greedy": self._mean(prompts, greedy)}

    def _mean(self, prompts: list[str], completions: list[str]) -> float:
        ok = []
        for p, c in zip(prompts, completions):
            try:
                ok.append(self.task.reward(p, c))
            except RewardRejected:  # left out of the mean, as the project's eval does
                pass
        return sum(ok) / len(ok) if ok else float("nan")


def trl_settings(cfg: Config, steps: int, seed: int) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """GRPOConfig keyword arguments for the project's config, and one note per setting: the project's
    key and value, TRL's, and whether they compute the same thing on-policy. One TRL step takes one
    generation batch of buffer.batch_groups prompts x buffer.group_size samples (the project's batch),
    in one optimizer step (trainer.minibatches=1, trainer.epochs=1)."""
    b, g, t = cfg.buffer, cfg.generator, cfg.trainer
    kwargs = dict(
        per_device_train_batch_size=b.batch_groups * b.group_size, gradient_accumulation_steps=1,
        num_generations=b.group_size, max_steps=steps, learning_rate=t.lr, lr_scheduler_type="constant",
        warmup_steps=t.warmup_steps, weight_decay=t.weight_decay, max_grad_norm=t.grad_clip,
        beta=t.kl_coef, use_bias_correction_kl=False, epsilon=t.clip_eps, num_iterations=t.epochs,
        loss_type="dapo" if t.aggregation == "token_mean" else "grpo",
        scale_rewards="group" if b.normalize_std else "none",
        temperature=g.temperature, top_p=1.0, top_k=0, max_completion_length=g.max_new_tokens,
        shuffle_dataset=False, seed=seed, data_seed=seed, use_cpu=True, bf16=False, use_vllm=False,
        logging_steps=1, save_strategy="no", report_to="none", remove_unused_columns=False,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    same, differ = "same", "differs"
    notes = [
        dict(setting="batch", project=f"buffer.batch_groups={b.batch_groups} x buffer.group_size={b.group_size}",
             trl=f"per_device_train_batch_size={kwargs['per_device_train_batch_size']}, num_generations={b.group_size}",
             verdict=same),
        dict(setting="optimizer", project=f"AdamW lr={t.lr}, constant (warmup {t.warmup_steps}), wd={t.weight_decay}, "
             f"clip {t.grad_clip}", trl="AdamW, lr_scheduler_type=constant, same lr, wd, max_grad_norm", verdict=same),
        dict(setting="optimizer state at the start of RL", project="side project: the AdamW moments of the warm "
             "start's supervised steps carry into RL (one optimizer); side project_fresh: fresh, from the export",
             trl="fresh AdamW moments", verdict=f"{differ} for side project; same for project_fresh"),
        dict(setting="KL", project=f"trainer.kl_coef={t.kl_coef}, k3 in the loss, reference = the warm start",
             trl=f"beta={t.kl_coef} (k3 in the loss, reference = the model it starts from), use_bias_correction_kl=False",
             verdict=same if t.kl_estimator == "k3" else f"{differ}: trainer.kl_estimator={t.kl_estimator}, TRL has k3"),
        dict(setting="loss aggregation", project=f"trainer.aggregation={t.aggregation}",
             trl=f"loss_type={kwargs['loss_type']}", verdict=same),
        dict(setting="advantages", project=f"group mean, over the unbiased group std + 1e-6 "
             f"(buffer.normalize_std={b.normalize_std})", trl=f"scale_rewards={kwargs['scale_rewards']}, "
             "unbiased std + 1e-4", verdict="same but for the epsilon (all-equal groups: advantage 0 in both)"),
        dict(setting="PPO clip", project=f"trainer.clip_eps={t.clip_eps}, dual_clip={t.dual_clip}, "
             f"minibatches={t.minibatches}, epochs={t.epochs}", trl=f"epsilon={t.clip_eps}, num_iterations={t.epochs}, "
             "no dual clip", verdict=same if t.minibatches == 1 and t.epochs == 1 else
             f"{differ}: trainer.minibatches > 1 has no TRL counterpart here"),
        dict(setting="off-policy correction", project=f"trainer.correction={t.correction} (run.mode={cfg.run.mode}: "
             "sampler = vLLM at the trained version; ratio 1 up to vLLM/torchtitan numerics)",
             trl="none needed: HF generate with the trained model itself", verdict="same on-policy"),
        dict(setting="sampling", project=f"vLLM, temperature={g.temperature}, top_p=1, max_new_tokens={g.max_new_tokens}",
             trl=f"HF generate, temperature={g.temperature}, top_p=1, top_k=0, max_completion_length={g.max_new_tokens}",
             verdict="same distribution; different random streams"),
        dict(setting="prompts", project=f"the task's train stream (task.seed={cfg.task.seed}) in order",
             trl="the same prompts, in the same order (shuffle_dataset=False)",
             verdict="same, but for prompts a dropped group re-admits in the project"),
    ]
    return kwargs, notes


class _Recorder(TrainerCallback):
    """Held-out eval at step 0 and every `eval_every` steps (and the last), TRL's own step logs, wall time."""

    def __init__(self, ev: HFEval, seed: int, eval_every: int, tok):
        self.ev, self.seed, self.every, self.tok = ev, seed, eval_every, tok
        self.rows: list[dict] = []
        self.t0 = time.monotonic()

    def _eval(self, step: int, model) -> None:
        m = self.ev.evaluate(model, self.tok, self.seed * 100_003 + step)
        self.rows.append({"step": step, "time_s": time.monotonic() - self.t0, **m})

    def on_train_begin(self, args, state, control, model=None, **kw):
        self._eval(0, model)

    def on_step_end(self, args, state, control, model=None, **kw):
        s = state.global_step
        if s % self.every == 0 or s == state.max_steps:
            self._eval(s, model)

    def on_log(self, args, state, control, logs=None, **kw):
        keep = {k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))}
        self.rows.append({"step": state.global_step, "time_s": time.monotonic() - self.t0, **keep})


def run_trl(cfg: Config, task: Task, warm_dir: Path, seed: int, steps: int, eval_every: int, out: Path) -> dict:
    """`steps` GRPOTrainer steps from the HF model in `warm_dir` on the task's train prompts, held-out
    eval on the way. Returns {"rows": [...], "settings": notes, "trained_samples": n, "wall_s": s} and
    writes it to out/trl.json."""
    require_trl()
    check_task(task, cfg)
    kwargs, notes = trl_settings(cfg, steps, seed)
    n_prompts = steps * cfg.buffer.batch_groups
    data = Dataset.from_list([{"prompt": it.prompt} for it in take(task, cfg.task.seed, "train", n_prompts)])
    if len(data) < n_prompts:
        raise SystemExit(f"peer_compare: task {task.name}'s train split has {len(data)} prompts, {steps} steps need "
                         f"{n_prompts} (the TRL side reads one pass, in order)")
    scored = [0]

    def task_reward(prompts, completions, **_):
        scored[0] += len(completions)
        out = []
        for p, c in zip(prompts, completions):
            try:
                out.append(task.reward(p, c))
            except RewardRejected:
                out.append(None)  # TRL: unscorable, advantage 0
        return out

    tok = AutoTokenizer.from_pretrained(str(warm_dir))
    model = AutoModelForCausalLM.from_pretrained(str(warm_dir), dtype=torch.float32)
    rec = _Recorder(HFEval(cfg, task), seed, eval_every, tok)
    args = trl.GRPOConfig(output_dir=str(out / "trl_output"), **kwargs)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[task_reward], args=args, train_dataset=data,
                              processing_class=tok, callbacks=[rec])
    trainer.remove_callback(PrinterCallback)  # its per-step dicts on stdout; the rows keep them
    t0 = time.monotonic()
    trainer.train()
    res = {"rows": rec.rows, "settings": notes, "trained_samples": scored[0], "wall_s": time.monotonic() - t0,
           "trl_version": trl.__version__}
    out.mkdir(parents=True, exist_ok=True)
    (out / "trl.json").write_text(json.dumps(res, indent=1))
    return res
