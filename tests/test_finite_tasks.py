"""Tasks as users write them: finite prompt sources served in epochs (shuffle, budget, resume), the
JSONL task and its bad files, one tokenization of a prompt everywhere, and one real CLI run on a
finite JSONL task that ends at its end of data.

    .venv/bin/python -m pytest -q tests/test_finite_tasks.py -m "not slow"   # the unit tests, seconds
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from pipeline.config import Config, ConfigError, TaskConfig, load_config
from pipeline.tasks import PromptStream, RewardRejected, TaskError, epoch_order, load_task, open_task, take
from pipeline.types import PromptItem

from .conftest import REPO

CAPITALS = REPO / "examples" / "tasks" / "capitals.jsonl"


def items(n: int) -> list[PromptItem]:
    return [PromptItem(uid=i, prompt=f"rev {chr(97 + i % 8) * (1 + i // 8)}=") for i in range(n)]


def task_of(prompts, name: str = "finite_task"):
    mod = types.SimpleNamespace(prompts=prompts, reward=lambda p, c: 0.0)
    sys.modules[name] = mod  # load_task imports it by name
    return load_task(name)


def list_task(n: int):
    return task_of(lambda seed, split: items(n))


def generator_task(n: int, calls: list | None = None):
    def prompts(seed, split):
        if calls is not None:
            calls.append(split)
        yield from items(n)
    return task_of(prompts, "finite_generator_task")


def uids(stream, n: int | None = None) -> list[int]:
    return [it.uid for it in (stream if n is None else (next(stream) for _ in range(n)))]


# ---- epochs, shuffle, budget -----------------------------------------------------------------


def test_a_finite_list_is_served_in_seeded_shuffled_epochs_and_ends_after_run_epochs():
    s = PromptStream(list_task(7), seed=3, epochs=3)
    got = uids(s)
    epochs = [got[0:7], got[7:14], got[14:21]]
    assert len(got) == 21 and all(sorted(e) == list(range(7)) for e in epochs)  # every item once per epoch
    assert len({tuple(e) for e in epochs}) == 3  # each epoch has its own order
    assert epochs == [epoch_order(7, 3, "train", k) for k in range(3)]
    assert uids(PromptStream(list_task(7), seed=3, epochs=3)) == got  # deterministic from the seed
    assert uids(PromptStream(list_task(7), seed=4, epochs=3)) != got
    assert s.progress() == 3.0
    with pytest.raises(StopIteration):  # and it stays ended
        next(s)


def test_a_finite_generator_is_read_in_order_once_then_kept_and_shuffled_and_unbounded_epochs_cycle():
    calls: list = []
    s = PromptStream(generator_task(5, calls), seed=0, epochs=0)
    got = uids(s, 5 * 4)
    assert got[:5] == [0, 1, 2, 3, 4]  # the first pass as the task yields it (it might never end)
    assert [got[5 * k:5 * k + 5] for k in (1, 2, 3)] == [epoch_order(5, 0, "train", k) for k in (1, 2, 3)]
    assert calls == ["train", "train"]  # the first pass, then one read into memory for every later epoch
    assert s.progress() == pytest.approx(4.0)


def test_an_infinite_generator_is_served_as_it_is():
    task = load_task("pipeline.tasks.reverse")
    s = PromptStream(task, seed=0, epochs=2)
    assert [next(s) for _ in range(300)] == take(task, 0, "train", 300)
    assert s.progress() == 0.0  # never ends an epoch


@pytest.mark.parametrize("source", ["list", "generator"])
@pytest.mark.parametrize("k", [0, 3, 6, 9, 17, 18])  # 6: an epoch boundary; 18: the end of the last epoch
def test_resume_continues_the_same_shuffled_order_at_the_same_item(source, k):
    make = (lambda: list_task(6)) if source == "list" else (lambda: generator_task(6))
    s = PromptStream(make(), seed=1, epochs=3)
    head = uids(s, k)
    state = json.loads(json.dumps(s.state_dict()))  # plain data: it goes into controller_state.pt
    rest = uids(s)
    s2 = PromptStream(make(), seed=1, epochs=3)
    s2.load_state_dict(state)
    assert uids(s2) == rest and len(head + rest) == 18
    assert s2.progress() == 3.0


def test_resume_refuses_another_seed_or_dataset_length_and_reads_a_single_pass_checkpoint():
    s = PromptStream(list_task(6), seed=1)
    uids(s, 8)
    state = s.state_dict()
    with pytest.raises(TaskError, match="task.seed=1.*task.seed=2"):
        PromptStream(list_task(6), seed=2).load_state_dict(state)
    with pytest.raises(TaskError, match="the checkpoint's epochs have 6 prompts, prompts.seed, split. now yields 5"):
        PromptStream(list_task(5), seed=1).load_state_dict(state)
    with pytest.raises(TaskError, match="yielded 5 prompts where it yielded .or the checkpoint recorded. 6"):
        PromptStream(generator_task(5), seed=1).load_state_dict(state)
    old = {"root": {"_num_yielded": 4}, "num_yielded": 4}  # IterableWrapper's state, before epochs
    s3 = PromptStream(load_task("pipeline.tasks.arith"), seed=5)
    s3.load_state_dict(old)
    assert next(s3) == take(load_task("pipeline.tasks.arith"), 5, "train", 5)[4]


def test_an_empty_train_split_fails_at_start_naming_the_task(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(TaskError, match=r"task 'pipeline.tasks.jsonl': the train split is empty"):
        open_task(TaskConfig(name="pipeline.tasks.jsonl", path=str(empty)), evaluate=False)
    task_of(lambda seed, split: iter(()), "user_tasks.empty")
    with pytest.raises(TaskError, match=r"task 'user_tasks.empty': the train split is empty"):
        open_task(TaskConfig(name="user_tasks.empty"), evaluate=False)


def test_a_short_eval_split_is_used_whole_and_said_so_and_an_empty_one_fails_when_evaluating(tmp_path, caplog):
    ev = tmp_path / "eval.jsonl"
    ev.write_text("".join(json.dumps({"prompt": f"capital of {c}?", "answer": a}) + "\n"
                          for c, a in [("france", "paris"), ("peru", "lima"), ("cuba", "havana")]))
    cfg = TaskConfig(name="pipeline.tasks.jsonl", path=str(CAPITALS), eval_path=str(ev), eval_prompts=32)
    with caplog.at_level(logging.INFO, logger="pipeline.tasks"):
        task = open_task(cfg, evaluate=True)
    assert len(take(task, 0, "eval", 32)) == 3
    assert "the eval split has 3 prompts, fewer than task.eval_prompts=32" in caplog.text
    no_eval = TaskConfig(name="pipeline.tasks.jsonl", path=str(CAPITALS))
    with pytest.raises(TaskError, match=r"eval split is empty.*task.eval_path.*run.eval_every=0"):
        open_task(no_eval, evaluate=True)
    assert open_task(no_eval, evaluate=False).name == "pipeline.tasks.jsonl"


def test_config_checks_run_epochs_and_the_task_files(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config(REPO / "configs/tiny.yaml", ["run.epochs=2", f"task.path={CAPITALS.relative_to(REPO)}"])
    assert cfg.run.epochs == 2 and cfg.task.path == str(CAPITALS) and Path(cfg.task.path).is_absolute()
    assert Config().run.epochs == 0 and Config().task.path == ""
    for bad, key in (("run.epochs=-1", "run.epochs"), (f"task.path={tmp_path}/none.jsonl", "task.path"),
                     (f"task.eval_path={tmp_path}", "task.eval_path")):
        with pytest.raises(ConfigError, match=key):
            load_config(None, [bad])


# ---- the JSONL task ------------------------------------------------------------------------------


def jsonl_task(path, eval_path=""):
    return load_task("pipeline.tasks.jsonl", TaskConfig(name="pipeline.tasks.jsonl", path=str(path),
                                                        eval_path=str(eval_path)))


def test_jsonl_task_rewards_exact_answers_one_and_similar_ones_partially():
    from pipeline.models.tiny import CHARS

    task = jsonl_task(CAPITALS)
    train = take(task, 0, "train", 1000)
    assert len(train) == 48 and take(task, 0, "eval", 10) == []
    assert all(set(i.prompt + task.demonstration(i)) <= set(CHARS) for i in train)  # the tiny vocabulary
    assert all(task.reward(i.prompt, task.demonstration(i)) == 1.0 for i in train)
    assert task.reward("capital of france?", "  paris\n") == 1.0
    assert 0.5 < task.reward("capital of france?", "pari") < 1.0
    assert 0 < task.reward("capital of france?", "parisss") < task.reward("capital of france?", "pariss") < 1.0
    assert task.reward("capital of france?", "") == 0.0
    with pytest.raises(RewardRejected, match="reward_raised.*in neither task.path nor task.eval_path"):
        task.reward("capital of atlantis?", "x")


@pytest.mark.parametrize("line, why", [
    ('{"prompt": "a", "answer": "b"', "invalid JSON"),
    ('["a", "b"]', "expected a JSON object"),
    ('{"prompt": "a"}', "missing key.*'answer'"),
    ('{"prompt": 7, "answer": "b"}', "'prompt' must be a string, got int"),
    ('{"prompt": "a", "answer": null}', "'answer' must be a string, got NoneType"),
    ('{"prompt": "", "answer": "b"}', "'prompt' is empty"),
    ('{"prompt": "a", "answer": "b", "id": true}', "'id' must be a string or an integer"),
    ('{"prompt": "z", "answer": "b", "id": "q1"}', "id 'q1' repeats .*:1"),
])
def test_jsonl_bad_line_fails_at_load_naming_file_and_line(tmp_path, line, why):
    f = tmp_path / "data.jsonl"
    f.write_text('{"prompt": "x", "answer": "y", "id": "q1"}\n\n' + line + "\n")
    with pytest.raises(TaskError, match=f"{re.escape(str(f))}:3: .*{why}"):
        jsonl_task(f)


def test_jsonl_prompt_with_two_answers_fails_naming_both_lines_and_an_exact_repeat_is_kept(tmp_path):
    train, ev = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text('{"prompt": "a", "answer": "b"}\n{"prompt": "a", "answer": "b"}\n')
    ev.write_text('{"prompt": "c", "answer": "d"}\n{"prompt": "a", "answer": "e"}\n')
    assert [i.prompt for i in take(jsonl_task(train), 0, "train", 9)] == ["a", "a"]
    with pytest.raises(TaskError, match=re.escape(f"{ev}:2: prompt 'a' has answer 'e', but {train}:1 gives it 'b'")):
        jsonl_task(train, ev)
    with pytest.raises(TaskError, match="task.path is empty"):
        load_task("pipeline.tasks.jsonl")


# ---- one tokenization of a prompt ---------------------------------------------------------------


def bos_tokenizer_dir(tiny_dir: Path, out: Path) -> Path:
    """The tiny tokenizer with a Llama-style post-processor that adds <bos> to every encoding with
    special tokens (no Qwen or Llama tokenizer is on this machine, and nothing downloads)."""
    from tokenizers import Tokenizer, processors

    from pipeline.models.tiny import TINY_BOS_ID

    out.mkdir()
    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", TINY_BOS_ID)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text((tiny_dir / "tokenizer_config.json").read_text())
    return out


@pytest.mark.parametrize("variant", ["tiny", "adds_bos"])
def test_generation_and_warm_start_tokenize_a_prompt_the_same_way(tiny_dir, tmp_path, variant):
    """Episodes.prompt_tokens (the ids vLLM generates from, which the trainer gets back in each
    Rollout) and demo_batch (the warm start) must agree, special tokens included; a
    demonstration never gets one. Fails if either path tokenizes on its own."""
    from pipeline.driver.warm_start import demo_batch
    from pipeline.models.tiny import TINY_BOS_ID
    from pipeline.tokens import load_tokenizer
    from pipeline.generator.core import GeneratorCore

    hf = tiny_dir if variant == "tiny" else bos_tokenizer_dir(tiny_dir, tmp_path / "bos")
    tok = load_tokenizer(hf)
    cfg = Config(task=TaskConfig(name="pipeline.tasks.jsonl", path=str(CAPITALS), eval_prompts=0))
    core, task = GeneratorCore(cfg, 0), open_task(cfg.task, evaluate=False)
    core.engine.tok = tok
    demo = take(task, 0, "train", 6)
    ids, mask = demo_batch(tok, task, demo)
    for row, m, item in zip(ids.tolist(), mask.tolist(), demo):
        start = m.index(1.0)
        gen = list(core.episodes.prompt_tokens(item.prompt))
        assert row[:start] == gen, (variant, item.prompt)
        assert (gen[0] == TINY_BOS_ID) == (variant == "adds_bos")  # the tokenizer's own convention
        assert TINY_BOS_ID not in row[start:]  # no special token inside the demonstration
        assert tok.decode(row[start:start + len(item.answer)]) == item.answer


# ---- one real run ------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_run_on_a_finite_jsonl_task_ends_cleanly_at_its_end_of_data(tmp_path):
    """12 prompts, run.epochs=2, B=2 groups of G=2, run.steps far above what the data makes: the run
    trains every one of the 24 prompt-epochs (a group dropped as stale has its prompt admitted again,
    buffer.retry_stale), 12 batches, then ends as a normal end (exit 0, summary.json, HF export, summary.png) with data/epoch reported;
    its 3-prompt eval file is shorter than task.eval_prompts and is used whole, at step 0 and after the
    last step.

    The same run is what a person watching it sees, at the default run.log_level: no INFO line from
    any process (vLLM logs several at every weight update), no rotary reload warning, our own
    warnings still shown (a collapse warning provoked at step 1), the progress bar; rollouts.jsonl
    holds run.log_rollouts samples per step whose logged reward is the task's reward of the logged
    prompt and completion, and whose versions fit the staleness bound."""
    data, ev = tmp_path / "rev12.jsonl", tmp_path / "rev_eval.jsonl"
    words = ["abc", "bad", "cab", "dab", "fed", "gag", "hag", "ace", "bed", "cafe", "face", "head"]
    data.write_text("".join(json.dumps({"id": i, "prompt": f"rev {w}=", "answer": w[::-1]}) + "\n"
                            for i, w in enumerate(words)))
    ev.write_text("".join(json.dumps({"prompt": f"rev {w}=", "answer": w[::-1]}) + "\n"
                          for w in ("dead", "bee", "hec")))
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "pipeline.run", "--config", "configs/tiny.yaml", "run.steps=50",
                        "run.epochs=2", "run.eval_every=100", "run.warm_start_steps=0",
                        "buffer.batch_groups=2", "buffer.group_size=2", "generator.concurrency=4",
                        "generator.max_new_tokens=6", "task.name=pipeline.tasks.jsonl", f"task.path={data}",
                        f"task.eval_path={ev}", "task.eval_prompts=8", "run.collapse_length=1000",
                        "run.collapse_patience=1", f"run.out_dir={out}"],
                       cwd=REPO, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-6000:]
    console = p.stdout + p.stderr
    assert not re.search(r"\bINFO\b", console), [line for line in console.splitlines() if "INFO" in line][:10]
    assert "RotaryEmbedding" not in console and "Loading safetensors checkpoint shards" not in console
    assert "WARNING pipeline.driver.hooks" in p.stderr and "step 1: the policy looks collapsed" in p.stderr
    assert "rl[async]" in p.stderr  # the progress bar
    assert "end of data: 2 epochs of prompts drawn (run.epochs=2)" in p.stdout, p.stdout[-2000:]
    assert "the eval split has 3 prompts, fewer than task.eval_prompts=8" in p.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "version/trainer" in r]
    n = len(steps)
    assert n == 12 and [r["step"] for r in steps] == list(range(1, n + 1))  # no prompt lost to staleness
    epochs = [r["data/epoch"] for r in steps]
    assert epochs == sorted(epochs) and 0 < epochs[0] and epochs[-1] > 1.5, epochs
    summary = json.loads((out / "summary.json").read_text())
    buf = summary["stats"]["buffer"]
    assert summary["ended"] == "data" and summary["steps"] == n and summary["version"] == n
    assert buf["data_epoch"] == 2.0 and buf["data_exhausted"] and buf["in_flight_groups"] == 0
    retried = buf["retried_prompts"]
    assert buf["dropped_groups"].get("stale", 0) == retried and buf["retry_waiting"] == 0
    assert buf["admitted_samples"] == (2 * 12 + retried) * 2 and buf["trained_samples"] == n * 2 * 2
    assert buf["admitted_samples"] == buf["trained_samples"] + buf["dropped_samples"] + buf["held_samples"]
    assert buf["held_samples"] == 0
    assert [s for s, *_ in summary["eval_curve"]] == [0, n]  # the final model was evaluated too
    assert (out / "summary.png").stat().st_size > 0 and (out / "hf_checkpoint" / "model.safetensors").is_file()

    task = open_task(TaskConfig(name="pipeline.tasks.jsonl", path=str(data), eval_path=str(ev)), evaluate=False)
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [s for s in range(1, n + 1) for _ in range(2)]  # run.log_rollouts=2
    for r in rows:
        assert r["reward"] == pytest.approx(task.reward(r["prompt"], r["completion"]), abs=1e-6), r
        assert r["trainer_version"] == r["step"] - 1 and r["prompt"].startswith("rev ")
        assert 1 <= len(r["versions"]) <= 6 and max(r["versions"]) <= r["trainer_version"], r
        assert r["staleness"] == r["trainer_version"] - min(r["versions"]) and 0 <= r["staleness"] <= 1, r
    assert all(a["group_id"] != b["group_id"] for a, b in zip(rows[::2], rows[1::2]))  # two groups a step
