"""The dataset task (local parquet, JSONL and arrow files through `datasets`), the math grader
(math-verify), the GSM8K-style example files, the eval's pass@k and mean@k. The CLI runs on the
dataset task with the math grader: tests/test_smollm2_run.py (the real SmolLM2 on the additions files,
pass@k and mean@k beside the eval reward) and tests/test_family_engines.py (qwen2 on these files).

    .venv/bin/python -m pytest -q tests/test_dataset_task.py   # seconds, no engine
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import re
from pathlib import Path

import datasets
import pytest
import yaml

from pipeline.config import ConfigError, TaskConfig, load_config
from pipeline.driver.evaluation import at_k, pass_at_k
from pipeline.generator.rewards import RewardScorer
from pipeline.tasks import RewardRejected, TaskError, load_task, open_task, take
from pipeline.tasks import graders
from pipeline.tasks.graders import completion_answer, final_answer, last_boxed, load_grader

from .conftest import REPO

TRAIN = REPO / "examples" / "gsm8k_style.jsonl"
EVAL = REPO / "examples" / "gsm8k_style_eval.jsonl"
NAME = "pipeline.tasks.dataset"


def dataset_task(path, eval_path="", **keys):
    return load_task(NAME, TaskConfig(name=NAME, path=str(path), eval_path=str(eval_path), **keys))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---- the math grader -----------------------------------------------------------------------------


@pytest.mark.parametrize("completion, reference, want", [
    ("The total is \\boxed{1,000}.", "1000", 1.0),
    ("So they have 1,000 stamps.", "#### 1000", 1.0),
    ("so 1000", "1,000", 1.0),
    ("It is 0.5 of the cake.", "1/2", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("half: 1/2", "\\frac{1}{2}", 1.0),
    ("The answer is \\boxed{\\frac12}", "Half of 4 is 2 out of 4.\n#### 0.5", 1.0),
    ("It fell to -6 degrees.", "9 - 15 = -6.\n#### -6", 1.0),
    ("It fell 6 degrees.", "#### -6", 0.0),  # the sign counts
    ("10-4", "#### 6", 0.0),  # a minus between operands is no sign: the last number is 4
    ("3.50 dollars", "3.5", 1.0),
    ("\\boxed{\\$18}", "18", 1.0),
    ("\\boxed{72 \\text{ apples}}", "72", 1.0),
    ("\\boxed{7} is wrong, it is 8", "7", 1.0),  # the boxed answer wins over a later number
    ("first 3, then 5, finally 8", "8", 1.0),  # no box: the last number
    ("first 3, then 5, finally 8", "3", 0.0),
    ("Half of 48 is 48/2=24.\n#### 24", "Half of 48 is 48/2=24.\n#### 24", 1.0),  # a GSM8K solution itself
    ("\\boxed{12", "12", 1.0),  # a box cut off by the token budget: the last number
    ("She has 17 left, 6 fewer than the 23 she picked.", "17", 0.0),  # a number after the answer: misread
    ("I do not know.", "7", 0.0),  # no answer at all
    ("", "7", 0.0),
    ("\\boxed{}", "3", 0.0),
    ("\\boxed{\\text{seven}}", "7", 0.0),
])
def test_math_last_number_grader_reads_the_boxed_or_last_number_and_compares_it_as_math(completion, reference, want):
    assert graders.math_last_number(completion, reference) == want
    # math reads the boxed answer alone: the same, where the completion has one
    assert graders.math(completion, reference) == (want if last_boxed(completion) is not None else 0.0)


@pytest.mark.parametrize("completion, reference, want", [
    ("She has \\boxed{17} left, 6 fewer than the 23 she picked.", "17", 1.0),  # a number after the box
    ("She has 17 left, 6 fewer than the 23 she picked.", "17", 0.0),  # no box: no answer, not the 23
    ("first 3, then 5, finally 8", "8", 0.0),
    ("So they have 1,000 stamps.", "#### 1000", 0.0),
    ("Half of 48 is 48/2=24.\n#### 24", "#### 24", 0.0),  # GSM8K's own marks are not the stated format
    ("\\boxed{12", "12", 0.0),  # a box cut off by the token budget
    ("\\boxed{3} at first, then \\boxed{1,000}.", "1000", 1.0),
])
def test_math_grader_reads_only_the_last_boxed_answer(completion, reference, want):
    assert graders.math(completion, reference) == want
    assert load_grader("pipeline.tasks.graders.math_last_number") is graders.math_last_number


def test_answers_are_taken_from_the_last_box_and_the_last_hash_marks():
    assert final_answer("Step one.\n#### 1,250 ") == "1,250" and final_answer(" 42 ") == "42"
    assert completion_answer("\\boxed{1} then \\boxed{\\frac{2}{3}}") == "\\frac{2}{3}"
    assert completion_answer("a \\boxed{x^{2}} b") == "x^{2}"  # nested braces kept
    assert completion_answer("from 1,250 to 2,000.5 and -.5") == "-.5"
    assert completion_answer("no digits here") is None


def test_an_empty_reference_is_rejected_not_scored_zero_and_exact_compares_strings():
    for empty in ("", "The steps.\n#### "):
        with pytest.raises(ValueError, match="cannot parse the reference answer ''"):
            graders.math("5", empty)
    assert graders.exact(" paris\n", "The capital is known.\n#### paris") == 1.0
    assert graders.exact("Paris", "paris") == 0.0


def test_grader_paths_resolve_or_fail_naming_the_key():
    assert load_grader("pipeline.tasks.graders.math") is graders.math
    for bad, why in (("pipeline.tasks.nothing.math", "cannot import"), ("pipeline.tasks.graders.nope", "has no 'nope'"),
                     ("pipeline.tasks.graders.NUMBER", "not a callable")):
        with pytest.raises(TaskError, match=f"task.grader={re.escape(repr(bad))}: .*{why}"):
            load_grader(bad)


def test_the_math_grader_runs_on_the_reward_worker_threads():
    """math-verify's own timeouts use SIGALRM, which fails off the main thread; rewards run on
    RewardScorer's threads, so the grader must work there (its timeouts off, the scorer's on)."""
    task = dataset_task(TRAIN)
    item = take(task, 0, "train", 1)[0]

    async def both():
        scorer = RewardScorer(task, timeout_s=30.0, workers=2)
        return await asyncio.gather(scorer.score(item.prompt, f"\\boxed{{{final_answer(item.answer)}}}"),
                                    scorer.score(item.prompt, "\\boxed{-99999}"))

    assert asyncio.run(both()) == [1.0, 0.0]


# ---- pass@k and mean@k ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4, 5, 7])
def test_pass_at_k_is_the_fraction_of_k_subsets_holding_a_correct_sample(n):
    for c in range(n + 1):
        samples = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            brute = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)  # fewer samples than k


def test_at_k_averages_over_prompts_counts_full_reward_as_a_pass_and_skips_short_prompts():
    got = at_k([[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 1.0, 1.0], [1.0]], k=2)  # the last has < k usable samples
    assert got["eval/pass@k"] == pytest.approx((pass_at_k(4, 1, 2) + pass_at_k(4, 2, 2)) / 2)
    assert got["eval/mean@k"] == pytest.approx((0.25 + 0.75) / 2)
    assert at_k([[0.9, 0.99]], k=1) == {"eval/pass@k": 0.0, "eval/mean@k": pytest.approx(0.945)}  # partial: no pass
    assert all(math.isnan(v) for v in at_k([[1.0]], k=2).values())


def test_eval_k_and_samples_are_checked_and_default_to_todays_four_samples():
    cfg = TaskConfig()
    assert (cfg.eval_samples, cfg.eval_k) == (4, 4)
    assert load_config(None, ["task.eval_samples=16", "task.eval_k=4"]).task.eval_k == 4
    for bad, key in ((["task.eval_k=5"], "task.eval_k"), (["task.eval_samples=0"], "task.eval_samples"),
                     (["task.eval_k=0"], "task.eval_k"), (["task.prompt_column="], "task.prompt_column"),
                     (["task.grader=math"], "task.grader")):
        with pytest.raises(ConfigError, match=key):
            load_config(None, bad)


# ---- the dataset task and its files --------------------------------------------------------------


def test_the_example_files_load_and_every_solution_is_a_full_reward_demonstration():
    from pipeline.config import GeneratorConfig

    task = open_task(TaskConfig(name=NAME, path=str(TRAIN), eval_path=str(EVAL), solution_column="answer"),
                     evaluate=True)
    train, ev = take(task, 0, "train", 1000), take(task, 0, "eval", 1000)
    assert len(train) == 40 and len(ev) == 10
    assert len({i.prompt for i in train + ev}) == 50 and len({i.uid for i in train + ev}) == 50
    room = GeneratorConfig().max_model_len - GeneratorConfig().max_new_tokens
    for item in train + ev:
        demo = task.demonstration(item)
        # the solution, its `#### N` line stated as the math grader reads an answer
        assert demo == f"{item.answer.rpartition('####')[0].rstrip()}\n\\boxed{{{final_answer(item.answer)}}}", demo
        assert task.reward(item.prompt, demo) == 1.0 and task.reward(item.prompt, item.answer) == 0.0
        assert task.reward(item.prompt, f"\\boxed{{{final_answer(item.answer)}}}") == 1.0
        assert task.reward(item.prompt, f"\\boxed{{{final_answer(item.answer)}1}}") == 0.0
        assert len(item.prompt) < room  # the tiny tokenizer: one token per character
    with pytest.raises(RewardRejected, match="reward_raised.*in neither task.path nor task.eval_path"):
        task.reward("How many moons?", "1")


@pytest.mark.parametrize("fmt", ["parquet", "arrow", "json"])
def test_parquet_arrow_and_json_copies_give_the_same_prompts_and_answers(tmp_path, fmt):
    ds = datasets.load_dataset("json", data_files=str(TRAIN), split="train")
    path = tmp_path / f"train.{fmt}"
    if fmt == "parquet":
        ds.to_parquet(str(path))
    elif fmt == "json":
        ds.to_json(str(path), lines=False)  # one JSON array
    else:
        path.write_bytes(Path(ds.cache_files[0]["filename"]).read_bytes())  # datasets' own Arrow stream file
    want, got = take(dataset_task(TRAIN), 0, "train", 100), take(dataset_task(path), 0, "train", 100)
    assert got == want and len(got) == 40


def test_columns_are_named_in_config_and_without_a_solution_column_there_is_no_demonstration(tmp_path):
    f = write_jsonl(tmp_path / "q.jsonl", [{"problem": "What is 2+3?", "solution": "2 + 3 = 5", "final": 5},
                                           {"problem": "What is 6/4?", "solution": "6 / 4 = 1.5", "final": 1.5}])
    task = dataset_task(f, prompt_column="problem", answer_column="final", solution_column="solution")
    items = take(task, 0, "train", 9)
    # numbers become strings; a float column makes 5 into 5.0, which the math grader finds equal to 5
    assert [(i.prompt, i.answer) for i in items] == [("What is 2+3?", "5.0"), ("What is 6/4?", "1.5")]
    assert task.demonstration(items[0]) == "2 + 3 = 5" and task.reward("What is 2+3?", "2 + 3 = \\boxed{5}") == 1.0
    assert task.reward("What is 6/4?", "it is \\boxed{3/2}") == 1.0 and task.reward("What is 6/4?", "it is 3/2") == 0.0
    assert dataset_task(f, prompt_column="problem", answer_column="final").demonstration is None
    exact = dataset_task(f, prompt_column="problem", answer_column="solution", grader="pipeline.tasks.graders.exact")
    assert exact.reward("What is 2+3?", "2 + 3 = 5") == 1.0 and exact.reward("What is 2+3?", "5") == 0.0


def test_a_missing_column_names_the_file_and_the_columns_it_has(tmp_path):
    f = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "What is 2+3?", "answer": "5"}])
    with pytest.raises(TaskError, match=re.escape(f"{f}: no column 'question' (task.prompt_column); "
                                                  "its columns: prompt, answer")):
        dataset_task(f)
    with pytest.raises(TaskError, match=re.escape("no column 'steps' (task.solution_column)")):
        dataset_task(f, prompt_column="prompt", solution_column="steps")


@pytest.mark.parametrize("row, why", [
    ({"question": "", "answer": "1"}, "column 'question' must hold a non-empty string prompt"),
    ({"question": None, "answer": "1"}, "column 'question' must hold a non-empty string prompt or a list of "
                                         "chat messages, got NoneType"),
    ({"question": "Q?", "answer": None}, "column 'answer' must hold the reference answer .*got NoneType"),
])
def test_a_bad_row_fails_at_load_naming_file_and_row(tmp_path, row, why):
    f = write_jsonl(tmp_path / "q.jsonl", [{"question": "What is 1+1?", "answer": "2"}, row])
    with pytest.raises(TaskError, match=f"{re.escape(str(f))} row 1: {why}"):
        dataset_task(f)


def test_a_messages_column_gives_chat_prompts_graded_by_prompt_and_bad_messages_name_the_row(tmp_path):
    chat = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 1+1?"}]
    f = write_jsonl(tmp_path / "chat.jsonl", [{"question": chat, "answer": "2"}])
    task = dataset_task(f)
    (item,) = task.prompts(0, "train")
    assert item.prompt == chat  # as the task gave it: the generators render it with the chat template
    assert task.reward(chat, "so it is \\boxed{2}") == 1.0 and task.reward(chat, "3") == 0.0
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": [{"content": "no role"}], "answer": "2"}])
    with pytest.raises(TaskError, match=r"bad.jsonl row 0: column 'question': .*role"):
        dataset_task(bad)


def test_apply_chat_template_sends_a_string_column_as_one_user_message(tmp_path):
    f = write_jsonl(tmp_path / "q.jsonl", [{"question": "What is 2+3?", "answer": "5"}])
    task = dataset_task(f, TRAIN, apply_chat_template=True, solution_column="answer")
    (item,) = take(task, 0, "train", 9)
    user = [{"role": "user", "content": "What is 2+3?"}]
    assert item.prompt == user and task.demonstration(item) == "5"
    assert task.reward(user, "\\boxed{5}") == 1.0 and task.reward(user, "4") == 0.0
    ev = take(task, 0, "eval", 100)
    assert len(ev) == 40 and all(len(i.prompt) == 1 and i.prompt[0]["role"] == "user" for i in ev)
    assert take(dataset_task(f), 0, "train", 9)[0].prompt == "What is 2+3?"  # off: a string stays raw
    chat = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 1+1?"}]
    msgs = write_jsonl(tmp_path / "chat.jsonl", [{"question": chat, "answer": "2"}])
    assert take(dataset_task(msgs, apply_chat_template=True), 0, "train", 9)[0].prompt == chat  # kept as given


def test_task_instruction_states_the_answer_format_after_every_prompt(tmp_path):
    f = write_jsonl(tmp_path / "q.jsonl", [{"question": "What is 2+3?", "answer": "5"}])
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1+1?"}]
    msgs = write_jsonl(tmp_path / "chat.jsonl", [{"question": chat, "answer": "2"}])
    say = "Put the final answer in \\boxed{}."
    (item,) = take(dataset_task(f, instruction=say), 0, "train", 9)
    assert item.prompt == "What is 2+3? Put the final answer in \\boxed{}."
    (item,) = take(dataset_task(f, instruction=say, apply_chat_template=True), 0, "train", 9)
    assert item.prompt == [{"role": "user", "content": "What is 2+3? Put the final answer in \\boxed{}."}]
    task = dataset_task(msgs, instruction=say)
    (item,) = take(task, 0, "train", 9)
    assert item.prompt == [chat[0], {"role": "user", "content": f"What is 1+1? {say}"}]  # the last user turn
    assert task.reward(item.prompt, "\\boxed{2}") == 1.0
    assert chat[1]["content"] == "What is 1+1?"  # the file's messages are not changed in place


def dataset_recipes() -> list[Path]:
    return sorted(p for p in (REPO / "configs").glob("*.yaml")
                  if (yaml.safe_load(p.read_text()).get("task") or {}).get("name") == NAME)


@pytest.mark.parametrize("recipe", dataset_recipes(), ids=lambda p: p.name)
def test_a_recipe_graded_on_the_boxed_answer_asks_for_it_in_every_prompt(recipe, monkeypatch):
    """The math grader reads the last \\boxed{} alone, so each prompt of a recipe that uses it says to
    box the answer (the data's own words or task.instruction); a recipe that scores the last number
    without a box names pipeline.tasks.graders.math_last_number."""
    monkeypatch.chdir(REPO)  # task.path is relative to the repository root
    cfg = TaskConfig(**yaml.safe_load(recipe.read_text())["task"])
    assert cfg.grader in ("pipeline.tasks.graders.math", "pipeline.tasks.graders.math_last_number"), cfg.grader
    task = open_task(cfg, evaluate=True)
    for item in take(task, 0, "train", 1000) + take(task, 0, "eval", 1000):
        text = item.prompt if isinstance(item.prompt, str) else item.prompt[-1]["content"]
        assert "\\boxed{}" in text, (recipe.name, text)


def test_only_local_files_in_known_formats_are_read(tmp_path):
    for bad in ("openai/gsm8k", str(tmp_path / "none.parquet")):
        with pytest.raises(ConfigError, match="task.path=.*an existing local file"):
            TaskConfig(name=NAME, path=bad)
    csv = tmp_path / "q.csv"
    csv.write_text("question,answer\nWhat is 1+1?,2\n")
    with pytest.raises(TaskError, match=r"unknown format '.csv'; a file ending in .parquet, .jsonl, .json, .arrow"):
        dataset_task(csv)
    broken = tmp_path / "q.parquet"
    broken.write_text("not parquet")
    with pytest.raises(TaskError, match=f"cannot read {re.escape(str(broken))} as parquet"):
        dataset_task(broken)
    with pytest.raises(TaskError, match="task.path is empty"):
        load_task(NAME)


def test_a_prompt_with_two_answers_fails_naming_both_rows(tmp_path):
    train = write_jsonl(tmp_path / "t.jsonl", [{"question": "Q?", "answer": "1"}, {"question": "Q?", "answer": "1"}])
    ev = write_jsonl(tmp_path / "e.jsonl", [{"question": "Q?", "answer": "2"}])
    assert len(take(dataset_task(train), 0, "train", 9)) == 2  # an exact repeat is kept
    with pytest.raises(TaskError, match=re.escape(f"{ev} row 0: prompt 'Q?' has answer '2', but {train} row 0")):
        dataset_task(train, ev)
