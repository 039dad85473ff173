"""tools/compare/peer_compare.py's pure parts: the settings map to TRL, the missing-extra message, the report;
on the SmolLM2 recipe (configs/smollm2-135m-add.yaml): its settings map, the reward on TRL's
conversational completions, the prompt ids TRL generates from against encode_prompt's, HFEval's
pass@k on chat prompts (a stand-in model), and recorded CLI runs as the project side.

TRL itself is an optional extra (pip install -e '.[peer]'); these tests run no trainer and no model,
and only the one that calls TRL's own tokenizing code needs it (skipped without it). The SmolLM2
tests read the folder `make setup` builds under .cache/smollm2 (skipped without it). The
comparison's real runs are in docs/results/benchmarks.md ("Against TRL").
"""

import sys
from pathlib import Path

import pytest

from pipeline.config import load_config
from tools.compare import peer_compare
from tools.lib import peer_trl


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


# --- the real-model recipe (configs/smollm2-135m-add.yaml): chat prompts, no warm start, recorded runs ---

SMOLLM2 = "configs/smollm2-135m-add.yaml"


def smollm2_dir() -> Path:
    """The SmolLM2 folder `make setup` builds under .cache/smollm2 (the config's builtin:), or a skip."""
    root = Path(__file__).resolve().parents[1] / ".cache" / "smollm2"
    found = sorted(root.glob("*/tokenizer_config.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        pytest.skip(f"no built SmolLM2 folder under {root} (make setup, or python -m pipeline.models.smollm2, builds it)")
    return found[-1].parent


def recipe(hf_dir, *overrides):
    """The recipe's config and task without resolving builtin: (which would build the folder)."""
    from pipeline.tasks import load_task

    cfg = load_config(SMOLLM2, [f"model.hf_dir={hf_dir}", *overrides])
    return cfg, load_task(cfg.task.name, cfg.task)


def test_trl_settings_for_the_smollm2_recipe_say_where_it_differs():
    cfg, _ = recipe("/not/built")
    kw, notes = peer_trl.trl_settings(cfg, steps=10, seed=11)
    assert (kw["per_device_train_batch_size"], kw["num_generations"], kw["learning_rate"], kw["beta"]) == (32, 8, 5e-6, 0.0)
    assert (kw["temperature"], kw["max_completion_length"], kw["bf16"], kw["chat_template_kwargs"]) == (0.7, 96, False, None)
    assert (kw["loss_type"], kw["scale_rewards"], kw["epsilon"], kw["epsilon_high"]) == ("dapo", "group", 0.2, 0.2)
    note = {n["setting"]: n for n in notes}
    assert "run.warm_start_steps=0" in note["start"]["project"] and note["start"]["verdict"] == "same"
    assert "float32" in note["model dtype"]["project"] and "bf16=False" in note["model dtype"]["trl"]
    assert note["off-policy correction"]["verdict"].startswith("differs") and "tis" in note["off-policy correction"]["project"]
    assert "run.mode=async" in note["off-policy correction"]["project"]
    assert "no KL term" in note["KL"]["project"] and note["KL"]["verdict"] == "same"
    assert "trainer.aggregation=token_mean (trainer.recipe=none)" == note["loss aggregation"]["project"]
    assert "task.eval_k=2" in note["eval"]["project"]
    # the project side run here (sync) is on-policy; a recipe's aggregation maps to TRL's normaliser
    _, notes = peer_trl.trl_settings(cfg, steps=10, seed=11, project_mode="sync")
    assert next(n for n in notes if n["setting"] == "off-policy correction")["verdict"] == "same on-policy"
    cfg, _ = recipe("/not/built", "trainer.recipe=dr_grpo")
    kw, _ = peer_trl.trl_settings(cfg, steps=10, seed=11)
    assert (kw["loss_type"], kw["scale_rewards"]) == ("dr_grpo", "none")
    cfg, _ = recipe("/not/built", "model.dtype=bfloat16", "trainer.entropy_coef=0.01")
    kw, notes = peer_trl.trl_settings(cfg, steps=10, seed=11)
    assert kw["bf16"] is True and next(n for n in notes if n["setting"] == "other loss parts")["verdict"] == "differs"


def test_the_reward_reads_trl_conversational_completions_and_keys_by_the_item_prompt():
    from datasets import Dataset

    cfg, task = recipe("/not/built")
    peer_trl.check_task(task, cfg)  # chat prompts are compared now
    items = peer_trl.train_items(task, cfg, 4)
    assert [i.prompt for i in items] != [i.prompt for i in peer_trl.take(task, cfg.task.seed, "train", 4)]  # the stream's order
    data = Dataset.from_list([{"prompt": it.prompt, "row": k} for k, it in enumerate(items)])
    prompts = [data[k]["prompt"] for k in range(len(data))]
    assert prompts == [it.prompt for it in items]  # the Arrow round trip keeps the messages as they are
    answers = [it.answer for it in items]
    completions = [[{"role": "assistant", "content": f"The sum is \\boxed{{{a}}}."}] for a in answers]
    completions[1] = [{"role": "assistant", "content": "The sum is \\boxed{-1}."}]
    completions[2] = [{"role": "assistant", "content": [{"type": "text", "text": f"\\boxed{{{answers[2]}}}"}]}]
    counter = [0]
    fn = peer_trl.task_reward_fn(task, items, counter)
    assert fn(prompts=prompts, completions=completions, row=[0, 1, 2, 3]) == [1.0, 0.0, 1.0, 1.0]
    texts = [peer_trl.completion_text(c) for c in completions]  # the standard format: str completions
    assert fn(prompts=prompts, completions=texts) == [1.0, 0.0, 1.0, 1.0]
    assert counter[0] == 8
    assert peer_trl.completion_text([{"role": "assistant", "content": "x"}, {"role": "tool", "content": "y"}]) == "x"


def test_trl_generates_from_the_project_prompt_ids_on_smollm2():
    """Every prompt of the recipe (train and held-out), rendered the way TRL 1.16's
    GRPOTrainer._tokenize_prompts renders a batch of conversational prompts (apply_chat_template,
    tokenize=True, add_generation_prompt=True, the tokenizer's own template, no tools), has
    encode_prompt's ids; a difference is named."""
    from pipeline.tokens import load_tokenizer

    hf = smollm2_dir()
    cfg, task = recipe(hf)
    tok = load_tokenizer(hf)
    prompts = [it.prompt for split in ("train", "eval") for it in task.prompts(cfg.task.seed, split)]
    assert len(prompts) == 2128 and all(isinstance(p, list) for p in prompts)
    ids = tok.apply_chat_template(conversation=prompts, tools=None, chat_template=None, add_generation_prompt=True,
                                  tokenize=True, return_dict=True)["input_ids"]
    assert peer_trl.prompt_id_mismatch(tok, prompts, ids) is None
    bare = tok.apply_chat_template(conversation=prompts[:3], add_generation_prompt=False, tokenize=True,
                                   return_dict=True)["input_ids"]
    with pytest.raises(SystemExit, match=r"prompt 0 .*TRL's ids \(\d+ tokens\) differ from encode_prompt's"):
        peer_trl.check_prompt_ids(tok, prompts[:3], bare)


def test_trl_own_tokenizing_code_gives_the_project_prompt_ids_on_smollm2():
    """The same through TRL's own method (what run_trl asks the built trainer at start-up)."""
    if peer_trl.trl is None:
        pytest.skip('trl is not installed (the optional extra: pip install --no-deps "trl==1.16.*" accelerate)')
    from pipeline.tokens import load_tokenizer

    hf = smollm2_dir()
    cfg, task = recipe(hf)
    tok = load_tokenizer(hf)
    prompts = [it.prompt for split in ("train", "eval") for it in task.prompts(cfg.task.seed, split)]
    assert peer_trl.prompt_id_mismatch(tok, prompts, peer_trl.trl_prompt_ids(prompts, tok=tok)) is None
    assert peer_trl.trl_stop_ids(tok) == [tok.eos_token_id]  # <|im_end|>: the project's stop set too


class _Answers:
    """A stand-in model whose `generate` writes \\boxed{answer} (right or wrong, by a rule) after each
    left-padded prompt: HFEval's decoding, scoring and pass@k on real chat prompts, without a model."""

    training = False

    def __init__(self, tok, items, right):
        from pipeline.tokens import encode_completion, encode_prompt

        self.tok, self.right, self.calls = tok, right, 0
        self.answer = {tuple(encode_prompt(tok, it.prompt)): it.answer for it in items}
        self.enc = lambda text: encode_completion(tok, text) + [tok.eos_token_id]

    def eval(self):
        pass

    def train(self, mode=True):
        pass

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, eos_token_id, do_sample, **kw):
        import torch

        rows = []
        for j, (ids, att) in enumerate(zip(input_ids.tolist(), attention_mask.tolist())):
            p = tuple(x for x, a in zip(ids, att) if a)
            i, s = j % len(self.answer), j // len(self.answer)
            ok = True if not do_sample else self.right(i, s)
            rows.append(self.enc(f"\\boxed{{{self.answer[p] if ok else -1}}}"))
        width = max(map(len, rows))
        out = [r + [pad_token_id] * (width - len(r)) for r in rows]
        return torch.cat([input_ids, torch.tensor(out)], dim=1)


def test_hf_eval_reports_pass_at_k_on_chat_prompts():
    from pipeline.tokens import load_tokenizer

    hf = smollm2_dir()
    cfg, task = recipe(hf, "task.eval_prompts=4")
    tok = load_tokenizer(hf)
    ev = peer_trl.HFEval(cfg, task)
    right = {(0, 0), (1, 0), (0, 1), (2, 1)}  # (prompt, sample): prompt 0 twice, 1 and 2 once, 3 never
    m = ev.evaluate(_Answers(tok, ev.items, lambda i, s: (i, s) in right), tok, seed=0)
    assert m["eval/reward_greedy"] == 1.0 and m["eval/reward"] == 0.5
    assert m["eval/pass@k"] == 0.75 and m["eval/mean@k"] == 0.5  # k = task.eval_k = 2 of n = 2 samples


def _metrics(path: Path, steps: int, clock: float, rewards: dict) -> None:
    import json

    rows = [{"step": 0, "time_s": 200.0, "eval/reward": 0.1, "eval/reward_greedy": 0.1, "eval/pass@k": 0.2}]
    for s in range(1, steps + 1):
        row = {"step": s, "time_s": 200.0 + clock * s, "samples": 32.0, "reward/mean": 0.3, "entropy": 0.3,
               "kl_ref": 0.0, "response/length_mean": 20.0}
        if s in rewards:
            row.update({"eval/reward": rewards[s], "eval/reward_greedy": rewards[s], "eval/pass@k": rewards[s] + 0.1})
        rows.append(row)
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_recorded_runs_are_the_project_side_at_equal_trained_samples(tmp_path):
    for k, final in enumerate((0.4, 0.5, 0.6)):
        _metrics(tmp_path / f"smollm2-s{11 + k}", 25, 45.0, {5: 0.2, 10: final, 15: 0.9})
    dirs = [str(tmp_path / f"smollm2-s{11 + k}") for k in range(3)]
    rec = peer_compare.read_recorded(dirs, steps=10, batch=32)
    assert sorted(rec) == ["smollm2-s11", "smollm2-s12", "smollm2-s13"]
    assert rec["smollm2-s11"]["trained_samples"] == 320 and rec["smollm2-s11"]["wall_s"] == 650.0
    assert max(r["step"] for r in rec["smollm2-s12"]["rows"]) == 10  # rows up to --steps only

    def trl(final: float) -> dict:
        evals = [{"step": s, "time_s": 10.0 + 30.0 * s, "eval_s": 5.0, "eval/reward": v, "eval/reward_greedy": v,
                  "eval/pass@k": v + 0.1} for s, v in ((0, 0.1), (5, 0.2), (10, final))]
        logs = [{"step": s, "time_s": 9.0 + 30.0 * s, "step_s": 25.0, "reward": 0.3} for s in range(1, 11)]
        return {"rows": evals + logs, "trained_samples": 320, "wall_s": 300.0}

    res = {"runs": {**{f"pipeline.tasks.dataset/{n}/recorded": e for n, e in rec.items()},
                    **{f"pipeline.tasks.dataset/{s}/trl": trl(f) for s, f in ((11, 0.42), (12, 0.5), (13, 0.58))}}}
    rows = peer_compare.summary(res)
    assert {r["metric"] for r in rows} == {"eval/reward", "eval/reward_greedy", "eval/pass@k"}
    assert all(r["side"] == "recorded" and r["project"]["step"] == 10 and r["agree"] for r in rows)
    assert rows[0]["project"]["samples"] == 320 == rows[0]["trl"]["samples"]
    curves = peer_compare.curve_table(res)
    assert "| dataset | 10 | this project (recorded CLI runs) | 3 | 320 | 0.500 ± 0.100 (0.400..0.600) |" in curves
    # wall-clock at TRL's final step 10: project 200 + 450 s, TRL 10 + 300 s; from step 0's eval on 450 / 300
    assert "650 s / 310 s = **2.10x**" in curves and "450 s / 300 s = **1.50x**" in curves
    assert "| (recorded CLI runs) | 3 / 3 |" in peer_compare.table(rows)
    train = peer_compare.train_table(res)  # no KL term: TRL logs none, the project logs kl_ref 0.0 unmeasured
    assert "| dataset | TRL GRPOTrainer | 0.300 | – |" in train and "| this project (recorded CLI runs) | 0.300 | – |" in train
    assert "a step 25.0 s median" in peer_compare.run_line("d", "s11", "trl", res["runs"]["pipeline.tasks.dataset/11/trl"])
    assert peer_compare.report(tmp_path, res) == 0 and (tmp_path / "compare.png").exists()
    with pytest.raises(SystemExit, match="its last step is 25, --steps is 30"):
        peer_compare.read_recorded(dirs[:1], steps=30, batch=32)
    with pytest.raises(SystemExit, match="no metrics.jsonl"):
        peer_compare.read_recorded([str(tmp_path / "nothing")], steps=10, batch=32)
