"""The peer side of tools/compare/peer_compare.py: TRL's GRPOTrainer on this project's task and settings.

    ev = HFEval(cfg, task)                                   # the task's held-out prompts, as pipeline/driver/evaluation.py
    ev.evaluate(model, tokenizer, seed=0)                    # eval/reward, eval/reward_greedy, eval/pass@k, eval/mean@k
    kwargs, notes = trl_settings(cfg, steps=200, seed=0)     # GRPOConfig keyword arguments, and how each maps
    res = run_trl(cfg, task, start_dir, seed=0, steps=200, eval_every=25, out=Path("bench_out/x"))

TRL is an optional extra (`pip install --no-deps "trl==1.16.*" accelerate`, or `pip install -e '.[peer]'`):
it is imported here only if present, and `require_trl` says how to install it. TRL generates with
HF transformers' `generate` on CPU (no vLLM: `use_vllm=False`), so its sampler and learner are the
same model and every step is exactly on-policy.

Prompts: a task's prompt is a str or a list of chat messages. Each train prompt becomes one dataset
row `{"prompt": prompt, "row": i}`, in the order of the project's own train stream (`PromptStream`,
task.seed: a file task's stream is shuffled per epoch, so not file order); messages are TRL's
conversational format, which TRL renders with the tokenizer's chat template and
`add_generation_prompt=True` (task.enable_thinking, when set, goes in as chat_template_kwargs).
`run_trl` proves at start-up that the ids TRL generates from are the project's: it asks the built
trainer itself (`GRPOTrainer._tokenize_prompts`) for every train prompt's ids and exits naming the
first prompt whose ids differ from `pipeline.tokens.encode_prompt` (`check_prompt_ids`). The reward
function turns TRL's completions back into the project's: a conversational completion (a list of
message dicts, one assistant turn) becomes the text of its content (`completion_text`; TRL decodes it
with skip_special_tokens, as the project's generator does), and the prompt the task keys its answers
by is the row's own PromptItem prompt, not the copy that went through the dataset.

`HFEval` scores a model the way the project's eval does (task.eval_prompts held-out prompts through
`encode_prompt`, task.eval_samples samples each at generator.temperature plus one greedy completion,
generator.max_new_tokens, the task's reward, rejected rewards left out; eval/pass@k and eval/mean@k
with k = task.eval_k from each prompt's samples by the project's own estimator, `at_k` of
pipeline/driver/evaluation.py), with HF `generate`, so it scores TRL's policy and, as a
cross-check, the project's exports too.
"""

from __future__ import annotations

import itertools
import json
import time
import types
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback

from pipeline.config import Config
from pipeline.driver.evaluation import at_k
from pipeline.tasks import PromptStream, RewardRejected, Task, take
from pipeline.tokens import SpecialTokens, check_messages, encode_prompt

try:  # optional extras: peer_compare's project side and its report run without them
    import trl
except ImportError:
    trl = None
try:
    import accelerate
except ImportError:
    accelerate = None

INSTALL = 'pip install --no-deps "trl==1.16.*" accelerate   (or: pip install -e ".[peer]")'
LOSS_TYPES = {"token_mean": "dapo", "seq_mean": "grpo", "constant": "dr_grpo"}
"""trainer.aggregation -> TRL's loss_type with the same normaliser: the batch's loss tokens (dapo, over
the global accumulated batch: one batch here), each sequence's own token count (grpo), sequences x
max_completion_length (dr_grpo: Dr. GRPO's constant, generator.max_new_tokens here)."""


def require_trl() -> None:
    """Raise SystemExit with the install command when TRL (or accelerate, which its trainer needs) is missing."""
    missing = [name for name, mod in (("trl", trl), ("accelerate", accelerate)) if mod is None]
    if missing:
        raise SystemExit(f"peer_compare: the TRL side needs {' and '.join(missing)}, which "
                         f"{'is' if len(missing) == 1 else 'are'} not installed. Install the optional extra: {INSTALL}")


def check_task(task: Task, cfg: Config) -> None:
    """The comparison covers single-turn tasks whose prompts are a str or a list of chat messages (TRL's
    standard and conversational formats); a multi-turn task (an env) runs its environment its own way."""
    if task.env is not None:
        raise SystemExit(f"peer_compare: task {task.name} is multi-turn (an env); the TRL side compares single-turn tasks")
    first = take(task, cfg.task.seed, "train", 1)
    if first and not isinstance(first[0].prompt, str):
        check_messages(first[0].prompt)  # PromptError naming what is wrong


def chat_template_kwargs(cfg: Config) -> dict | None:
    """What the project passes the chat template beside the messages (encode_prompt's enable_thinking)."""
    return None if cfg.task.enable_thinking is None else {"enable_thinking": cfg.task.enable_thinking}


def train_items(task: Task, cfg: Config, n: int) -> list:
    """The first `n` prompts of the project's train stream, in its order (PromptStream: what the
    project's generators draw; a file task's is shuffled from the first epoch on, task.seed)."""
    return list(itertools.islice(PromptStream(task, cfg.task.seed, "train"), n))


def trl_prompt_ids(prompts: list, trainer=None, tok=None, template_kwargs: dict | None = None) -> list[list[int]]:
    """The token ids TRL generates from for `prompts`, by TRL's own code (`GRPOTrainer._tokenize_prompts`,
    trl 1.16): of a built `trainer`, or, given only `tok`, of a stand-in carrying what that method reads
    for a text model without tools (the tokenizer, no tools, the tokenizer's own chat template)."""
    if trl is None:
        require_trl()
    if trainer is None:
        trainer = types.SimpleNamespace(_is_vlm=False, environment_factories=None, processing_class=tok, tools=None,
                                        chat_template=None, chat_template_kwargs=template_kwargs or {})
    return [list(x) for x in trl.GRPOTrainer._tokenize_prompts(trainer, list(prompts))[0]]


def prompt_id_mismatch(tok, prompts: list, ids: list[list[int]], enable_thinking: bool | None = None) -> str | None:
    """None if `ids` are encode_prompt's ids of each of `prompts`; else what differs, for the first one."""
    if len(ids) != len(prompts):
        return f"{len(ids)} id lists for {len(prompts)} prompts"
    for k, (p, got) in enumerate(zip(prompts, ids)):
        want = encode_prompt(tok, p, enable_thinking)
        if list(got) != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            return (f"prompt {k} {json.dumps(p)[:120]}: TRL's ids ({len(got)} tokens) differ from encode_prompt's "
                    f"({len(want)}) from token {at}: TRL {tok.decode(list(got)[at:at + 12])!r}, project "
                    f"{tok.decode(want[at:at + 12])!r}")
    return None


def check_prompt_ids(tok, prompts: list, ids: list[list[int]], enable_thinking: bool | None = None) -> None:
    """SystemExit unless TRL's `ids` of `prompts` are the project's (prompt_id_mismatch)."""
    bad = prompt_id_mismatch(tok, prompts, ids, enable_thinking)
    if bad:
        raise SystemExit(f"peer_compare: TRL would generate from other prompt tokens than this project: {bad}. "
                         "The two sides would not see the same prompts; nothing was trained")


def completion_text(completion: Any) -> str:
    """The completion text the task's reward takes, from TRL's completion: a str (standard format) as
    it is; a conversational one (a list of messages: the assistant turn TRL decoded) the text of its
    assistant messages' content (a str, or content blocks whose text parts are joined)."""
    if isinstance(completion, str):
        return completion
    out = []
    for m in completion:
        if m.get("role", "assistant") != "assistant":
            continue
        content = m.get("content") or ""
        out.append(content if isinstance(content, str) else
                   "".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text"))
    return "".join(out)


def task_reward_fn(task: Task, items: list, counter: list[int] | None = None):
    """TRL's reward function for the task: each completion scored by `task.reward(prompt, text)`, the
    prompt being its dataset row's PromptItem prompt (`row` column; TRL's `prompts` as a fallback), the
    text `completion_text`'s. A RewardRejected reward is None (TRL: NaN, left out of the advantages'
    statistics, as the project leaves a rejected sample out). `counter[0]` counts the scored samples."""
    def task_reward(prompts, completions, row=None, **_):
        if counter is not None:
            counter[0] += len(completions)
        out = []
        for k, (p, c) in enumerate(zip(prompts, completions)):
            prompt = items[row[k]].prompt if row is not None else p
            try:
                out.append(task.reward(prompt, completion_text(c)))
            except RewardRejected:
                out.append(None)
        return out

    return task_reward


class HFEval:
    """Held-out eval with HF `generate` (contract in the module docstring). Seeded per call and run
    under `torch.random.fork_rng`, so evaluating never moves the training run's random stream.

    Example:
        ev = HFEval(cfg, task)
        model = AutoModelForCausalLM.from_pretrained(hf_dir); tok = AutoTokenizer.from_pretrained(hf_dir)
        m = ev.evaluate(model, tok, seed=0)     # eval/reward, eval/reward_greedy, eval/pass@k, eval/mean@k
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
        ids = [encode_prompt(tok, it.prompt, self.cfg.task.enable_thinking) for it in self.items]
        was_training = model.training
        model.eval()
        with torch.no_grad(), torch.random.fork_rng():
            torch.manual_seed(seed)
            greedy = self._generate(model, tok, ids, sample=False)
            sampled = self._generate(model, tok, ids * n, sample=True)
        model.train(was_training)
        prompts = [it.prompt for it in self.items]
        sampled_r = self._scores(prompts * n, sampled)
        per_prompt = [[r for r in sampled_r[i::len(prompts)] if r is not None] for i in range(len(prompts))]
        return {"eval/reward": _mean(sampled_r), "eval/reward_greedy": _mean(self._scores(prompts, greedy)),
                **at_k(per_prompt, self.cfg.task.eval_k)}

    def _scores(self, prompts: list, completions: list[str]) -> list[float | None]:
        out = []
        for p, c in zip(prompts, completions):
            try:
                out.append(self.task.reward(p, c))
            except RewardRejected:  # left out of the mean, as the project's eval does
                out.append(None)
        return out


def _mean(rewards: list[float | None]) -> float:
    ok = [r for r in rewards if r is not None]
    return sum(ok) / len(ok) if ok else float("nan")


def trl_stop_ids(tok) -> list[int]:
    """The ids that end a TRL completion, by TRL 1.16's rule: the eos ids of the checkpoint's
    generation_config.json, and the tokenizer's eos."""
    path = Path(tok.name_or_path or "") / "generation_config.json"
    eos = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return ids if tok.eos_token_id in ids else [tok.eos_token_id, *ids]


def trl_settings(cfg: Config, steps: int, seed: int, tok=None,
                 project_mode: str | None = None) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """GRPOConfig keyword arguments for the project's config, and one note per setting: the project's
    key and value, TRL's, and whether they compute the same thing. One TRL step takes one generation
    batch of buffer.batch_groups prompts x buffer.group_size samples (the project's batch), in one
    optimizer step (trainer.minibatches=1, trainer.epochs=1). `project_mode`: the run.mode of the
    project side compared (default cfg.run.mode; peer_compare's own project runs are sync); `tok`: the
    start's tokenizer, for the prompt-token and stop-token rows."""
    b, g, t, r = cfg.buffer, cfg.generator, cfg.trainer, cfg.run
    mode = project_mode or r.mode
    warm = r.warm_start_steps != 0
    bf16 = cfg.model.dtype == "bfloat16"
    kwargs = dict(
        per_device_train_batch_size=b.batch_groups * b.group_size, gradient_accumulation_steps=1,
        num_generations=b.group_size, max_steps=steps, learning_rate=t.lr, lr_scheduler_type="constant",
        warmup_steps=t.warmup_steps, weight_decay=t.weight_decay, max_grad_norm=t.grad_clip,
        beta=t.kl_coef, use_bias_correction_kl=False, epsilon=t.clip_eps_low, epsilon_high=t.clip_eps_high,
        num_iterations=t.epochs, loss_type=LOSS_TYPES[t.aggregation],
        scale_rewards="group" if b.normalize_std else "none", mask_truncated_completions=bool(t.overlong_filter),
        temperature=g.temperature, top_p=1.0, top_k=0, max_completion_length=g.max_new_tokens,
        chat_template_kwargs=chat_template_kwargs(cfg),
        shuffle_dataset=False, seed=seed, data_seed=seed, use_cpu=True, bf16=bf16, use_vllm=False,
        logging_steps=1, save_strategy="no", report_to="none", remove_unused_columns=False,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    same, differ = "same", "differs"
    start = (f"run.warm_start_steps={r.warm_start_steps}: side project trains its own warm start; project_fresh "
             "and TRL start from its export (out_dir/warm_start)") if warm else \
        f"run.warm_start_steps=0: RL starts from model.hf_dir itself ({cfg.model.hf_dir})"
    notes = [
        dict(setting="start", project=start, trl="the warm start's export" if warm else "the same folder",
             verdict=same),
        dict(setting="model dtype", project=f"model.dtype={cfg.model.dtype}" + (" (bf16 compute, fp32 master weights "
             "and AdamW state)" if bf16 else " (weights and AdamW state in float32)"),
             trl=f"loaded in float32, bf16={bf16}" + (" (autocast)" if bf16 else ""),
             verdict=same if not bf16 else "same in kind (two autocast implementations)"),
        dict(setting="batch", project=f"buffer.batch_groups={b.batch_groups} x buffer.group_size={b.group_size}",
             trl=f"per_device_train_batch_size={kwargs['per_device_train_batch_size']}, num_generations={b.group_size}",
             verdict=same),
        dict(setting="optimizer", project=f"AdamW lr={t.lr}, constant (warmup {t.warmup_steps}), wd={t.weight_decay}, "
             f"clip {t.grad_clip}", trl="AdamW, lr_scheduler_type=constant, same lr, wd, max_grad_norm", verdict=same),
        dict(setting="optimizer state at the start of RL", project="side project: the AdamW moments of the warm "
             "start's supervised steps carry into RL (one optimizer); side project_fresh: fresh, from the export"
             if warm else "fresh AdamW moments (no warm start)", trl="fresh AdamW moments",
             verdict=f"{differ} for side project; same for project_fresh" if warm else same),
        dict(setting="KL", project=f"trainer.kl_coef={t.kl_coef}" + (
             f", {t.kl_estimator} in the loss, reference = the {'warm start' if warm else 'model.hf_dir checkpoint'}"
             if t.kl_coef else ": no KL term, no reference forward"),
             trl=f"beta={t.kl_coef}" + (" (k3 in the loss, reference = the model it starts from), "
                                        "use_bias_correction_kl=False" if t.kl_coef else ": no reference model"),
             verdict=same if t.kl_estimator == "k3" or not t.kl_coef else
             f"{differ}: trainer.kl_estimator={t.kl_estimator}, TRL has k3"),
        dict(setting="loss aggregation", project=f"trainer.aggregation={t.aggregation} (trainer.recipe={t.recipe})",
             trl=f"loss_type={kwargs['loss_type']}", verdict=same),
        dict(setting="advantages", project=f"group mean, over the unbiased group std + 1e-6 "
             f"(buffer.normalize_std={b.normalize_std})" if b.normalize_std else
             "group mean, not scaled (buffer.normalize_std=False)", trl=f"scale_rewards={kwargs['scale_rewards']}"
             + (", unbiased std + 1e-4" if b.normalize_std else ""),
             verdict="same but for the epsilon (all-equal groups: advantage 0 in both)" if b.normalize_std else same),
        dict(setting="PPO clip", project=f"trainer.clip_eps_low/high={t.clip_eps_low}/{t.clip_eps_high}, "
             f"dual_clip={t.dual_clip}, minibatches={t.minibatches}, epochs={t.epochs}",
             trl=f"epsilon={t.clip_eps_low}, epsilon_high={t.clip_eps_high}, num_iterations={t.epochs}, no dual clip",
             verdict="same (one minibatch, one epoch: the PPO ratio is 1, so neither clip acts)"
             if t.minibatches == 1 and t.epochs == 1 else f"{differ}: trainer.minibatches > 1 has no TRL counterpart here"),
    ]
    if mode == "sync":
        notes.append(dict(setting="off-policy correction", project=f"trainer.correction={t.correction} (run.mode=sync: "
                          "sampler = vLLM at the trained version; weight 1 up to vLLM/torchtitan numerics)",
                          trl="none needed: HF generate with the trained model itself", verdict="same on-policy"))
    else:
        notes.append(dict(setting="off-policy correction", project=f"run.mode={mode}: vLLM samples while the trainer "
                          f"trains, tokens up to buffer.max_staleness={b.max_staleness} version(s) behind; "
                          f"trainer.correction={t.correction}" + (f" weights each token by min(π_old/μ, "
                          f"trainer.is_cap={t.is_cap})" if t.correction == "tis" else ""),
                          trl="none: on-policy (HF generate with the trained model itself, between steps)",
                          verdict=f"{differ}: the project trains partly on samples one version stale, corrected by "
                          f"{t.correction}; TRL waits for its own samples"))
    notes += [
        dict(setting="sampling", project=f"vLLM, temperature={g.temperature}, top_p=1, max_new_tokens={g.max_new_tokens}",
             trl=f"HF generate, temperature={g.temperature}, top_p=1, top_k=0, max_completion_length={g.max_new_tokens}",
             verdict="same distribution; different random streams"),
        dict(setting="prompts", project=f"the task's train stream (PromptStream, task.seed={cfg.task.seed}) in order",
             trl="the same stream's first steps x batch_groups prompts, in that order (shuffle_dataset=False)",
             verdict="same, but for prompts a dropped group re-admits in the project" if mode == "sync" else
             "nearly the same: the async project samples a few groups ahead and drops groups that grew too stale, "
             "so its batches follow the stream with small shifts"),
        dict(setting="eval", project=f"vLLM: task.eval_prompts={cfg.task.eval_prompts} held-out prompts, greedy + "
             f"task.eval_samples={cfg.task.eval_samples} at temperature {g.temperature}, pass@k with "
             f"task.eval_k={cfg.task.eval_k}", trl="HFEval: the same prompts, counts and estimator (at_k) on HF generate",
             verdict="same protocol; the project's vLLM eval samples from task.seed at every eval, HFEval from "
             "(seed, step)"),
    ]
    if t.overlong_buffer or t.entropy_coef or t.ratio_level != "token" or t.weight_form != "ppo" \
            or b.zero_signal != "keep":  # auto may turn dynamic sampling on, which TRL does not do
        notes.append(dict(setting="other loss parts", project=f"trainer.overlong_buffer={t.overlong_buffer}, "
                          f"entropy_coef={t.entropy_coef}, ratio_level={t.ratio_level}, weight_form={t.weight_form}, "
                          f"buffer.zero_signal={b.zero_signal}", trl="not mapped (TRL's defaults)", verdict=differ))
    if tok is not None:
        stop, trl_stop = sorted(SpecialTokens.of(tok).stop), sorted(set(trl_stop_ids(tok)))
        notes += [
            dict(setting="prompt tokens", project="pipeline.tokens.encode_prompt (a str as it is; messages through the "
                 "chat template, add_generation_prompt)", trl="GRPOTrainer._tokenize_prompts (the standard format "
                 "tokenized; conversational: apply_chat_template, add_generation_prompt=True)",
                 verdict="same ids: checked for every train prompt at start-up (run_trl exits otherwise)"),
            dict(setting="stop tokens", project=f"SpecialTokens.stop={stop}", trl=f"eos_token_ids={trl_stop}",
                 verdict=same if stop == trl_stop else differ),
        ]
    return kwargs, notes


class _Recorder(TrainerCallback):
    """Held-out eval at step 0 and every `eval_every` steps (and the last), TRL's own step logs, wall
    time since the recorder was made (the trainer's construction, its start-up, is inside it): every
    row's time_s; an eval row's eval_s (that eval alone); a step's log row's step_s (its generation
    and update, from on_step_begin to on_step_end, no eval)."""

    def __init__(self, ev: HFEval, seed: int, eval_every: int, tok):
        self.ev, self.seed, self.every, self.tok = ev, seed, eval_every, tok
        self.rows: list[dict] = []
        self.t0 = time.monotonic()

        self._step_t = self._step_s = None

    def _eval(self, step: int, model) -> None:
        t = time.monotonic()
        m = self.ev.evaluate(model, self.tok, self.seed * 100_003 + step)
        now = time.monotonic()
        self.rows.append({"step": step, "time_s": now - self.t0, "eval_s": now - t, **m})
        print(f"[peer_trl] step {step}: held-out {m['eval/reward']:.3f} sampled, {m['eval/reward_greedy']:.3f} greedy, "
              f"{m['eval/pass@k']:.3f} pass@k; eval {now - t:.1f} s, {now - self.t0:.0f} s in", flush=True)

    def on_train_begin(self, args, state, control, model=None, **kw):
        self._eval(0, model)

    def on_step_begin(self, args, state, control, **kw):
        self._step_t = time.monotonic()

    def on_step_end(self, args, state, control, model=None, **kw):
        self._step_s = time.monotonic() - self._step_t if self._step_t is not None else None
        if self._step_s is not None:
            print(f"[peer_trl] step {state.global_step}/{state.max_steps} trained in {self._step_s:.1f} s", flush=True)
        s = state.global_step
        if s % self.every == 0 or s == state.max_steps:
            self._eval(s, model)

    def on_log(self, args, state, control, logs=None, **kw):
        keep = {k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))}
        step_s = {} if self._step_s is None else {"step_s": self._step_s}  # generation and update, no eval
        self._step_s = None
        self.rows.append({"step": state.global_step, "time_s": time.monotonic() - self.t0, **step_s, **keep})


def run_trl(cfg: Config, task: Task, start_dir: Path, seed: int, steps: int, eval_every: int, out: Path,
            project_mode: str | None = None) -> dict:
    """`steps` GRPOTrainer steps from the HF model in `start_dir` (a warm-start export, or model.hf_dir
    itself without a warm start) on the task's train stream, held-out eval on the way. Exits before
    training if TRL's prompt ids differ from encode_prompt's. Returns {"rows": [...] (eval rows and
    TRL's step logs, each with time_s), "settings": notes, "trained_samples": n, "wall_s": s,
    "prompts_checked": n, "trl_version": v} and writes it to out/trl.json."""
    require_trl()
    check_task(task, cfg)
    tok = AutoTokenizer.from_pretrained(str(start_dir))
    kwargs, notes = trl_settings(cfg, steps, seed, tok, project_mode)
    n_prompts = steps * cfg.buffer.batch_groups
    items = train_items(task, cfg, n_prompts)
    if len(items) < n_prompts:
        raise SystemExit(f"peer_compare: task {task.name}'s train split has {len(items)} prompts, {steps} steps need "
                         f"{n_prompts} (the TRL side reads one pass, in order)")
    data = Dataset.from_list([{"prompt": it.prompt, "row": k} for k, it in enumerate(items)])
    scored = [0]
    model = AutoModelForCausalLM.from_pretrained(str(start_dir), dtype=torch.float32)
    rec = _Recorder(HFEval(cfg, task), seed, eval_every, tok)
    args = trl.GRPOConfig(output_dir=str(out / "trl_output"), **kwargs)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[task_reward_fn(task, items, scored)], args=args,
                              train_dataset=data, processing_class=tok, callbacks=[rec])
    trainer.remove_callback(PrinterCallback)  # its per-step dicts on stdout; the rows keep them
    prompts = [data[k]["prompt"] for k in range(len(data))]  # what TRL reads: the dataset's rows
    check_prompt_ids(tok, prompts, trl_prompt_ids(prompts, trainer=trainer), cfg.task.enable_thinking)
    if sorted(set(trainer.eos_token_ids)) != sorted(set(trl_stop_ids(tok))):
        raise SystemExit(f"peer_compare: TRL stops at {trainer.eos_token_ids}, not at trl_stop_ids' "
                         f"{trl_stop_ids(tok)}; the settings' stop-token row would be wrong")
    t0 = time.monotonic()
    trainer.train()
    res = {"rows": rec.rows, "settings": notes, "trained_samples": scored[0], "wall_s": time.monotonic() - t0,
           "prompts_checked": len(prompts), "start": str(start_dir), "trl_version": trl.__version__}
    out.mkdir(parents=True, exist_ok=True)
    (out / "trl.json").write_text(json.dumps(res, indent=1))
    return res
