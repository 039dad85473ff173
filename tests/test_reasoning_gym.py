"""The reasoning-gym task (pipeline/tasks/reasoning_gym.py) on real reasoning-gym datasets: prompts per
seed, the held-out eval seed, each dataset's own scorer, demonstrations, config errors naming the key,
and the load path the driver takes. Skipped where the optional `reasoning-gym` extra is not installed
(but for the test of the message that says how to install it).

    .venv/bin/python -m pytest -q tests/test_reasoning_gym.py   # seconds
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from pipeline.config import ConfigError, TaskConfig, load_config
from pipeline.tasks import PromptStream, RewardRejected, TaskError, load_task, open_task, take

from .conftest import REPO

NAME = "pipeline.tasks.reasoning_gym"
HAVE_RG = importlib.util.find_spec("reasoning_gym") is not None
needs_rg = pytest.mark.skipif(not HAVE_RG, reason="reasoning-gym is not installed (optional extra: "
                                                   "pip install reasoning-gym==0.1.25)")
DATASETS = ["basic_arithmetic", "chain_sum", "leg_counting", "letter_counting"]
SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"]}
"""basic_arithmetic with a problem space of a few hundred sums, so two seeds draw the same ones."""


def rg_task(dataset: str = "basic_arithmetic", **keys):
    keys.setdefault("rg_size", 50)
    keys.setdefault("eval_prompts", 8)
    return load_task(NAME, TaskConfig(name=NAME, rg_dataset=dataset, **keys))


def prompts(task, split: str) -> list:
    return [json.dumps(i.prompt) for i in take(task, 0, split, 10**6)]


@needs_rg
@pytest.mark.parametrize("dataset", DATASETS)
def test_prompts_are_deterministic_per_seed_and_change_with_it(dataset):
    a, b, c = rg_task(dataset), rg_task(dataset), rg_task(dataset, seed=1)
    assert take(a, 0, "train", 100) == take(b, 0, "train", 100) and len(take(a, 0, "train", 100)) == 50
    assert take(a, 0, "eval", 100) == take(b, 0, "eval", 100) and len(take(a, 0, "eval", 100)) == 8
    assert prompts(a, "train") != prompts(c, "train")
    assert take(a, 5, "train", 100) == take(a, 0, "train", 100)  # the stream's seed orders, it does not draw


@needs_rg
def test_the_same_prompts_in_another_process_with_other_string_hashing():
    """Each generator process builds the task itself and finds a prompt's entry by its text: the
    prompts must not depend on the process (PYTHONHASHSEED differs between processes)."""
    code = ("import json, sys\n"
            "from pipeline.config import TaskConfig\n"
            "from pipeline.tasks import load_task, take\n"
            "task = lambda d: load_task(sys.argv[1], TaskConfig(name=sys.argv[1], rg_dataset=d, rg_size=50, "
            "eval_prompts=8))\n"
            "print(json.dumps({d: [json.dumps(i.prompt) for i in take(task(d), 0, s, 100)] "
            "for d in sys.argv[2:] for s in ('train', 'eval')}))")
    p = subprocess.run([sys.executable, "-c", code, NAME, *DATASETS], cwd=REPO, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert p.returncode == 0, p.stderr[-3000:]
    there = json.loads(p.stdout.splitlines()[-1])
    here = {d: prompts(rg_task(d), s) for d in DATASETS for s in ("train", "eval")}
    assert there == here


@needs_rg
def test_eval_items_come_from_the_held_out_seed_and_never_repeat_a_train_item():
    import reasoning_gym

    from pipeline.tasks.reasoning_gym import EVAL_SEED_OFFSET

    task = rg_task(rg_config=SMALL, rg_size=300, eval_prompts=40)
    train, ev = take(task, 0, "train", 10**6), take(task, 0, "eval", 10**6)
    assert len(train) == 300 and len(ev) == 40
    train_q = {i.prompt for i in train}
    assert not train_q & {i.prompt for i in ev} and len({i.prompt for i in ev}) == 40
    assert [i.uid for i in train + ev] == list(range(340))
    # the filter is what keeps them apart here: the held-out seed's own items repeat train questions
    raw = reasoning_gym.create_dataset("basic_arithmetic", seed=EVAL_SEED_OFFSET, size=144, **SMALL)
    raw_q = [e["question"] for e in raw]
    assert sum(any(p.startswith(q + "\n") for p in train_q) for q in raw_q) > 10
    kept = [q for q in raw_q if not any(p.startswith(q + "\n") for p in train_q)]
    assert [i.prompt.partition("\n")[0] for i in ev] == list(dict.fromkeys(kept))[:40]  # index order, first kept


@needs_rg
@pytest.mark.parametrize("dataset", DATASETS)
def test_the_datasets_scorer_gives_its_own_answer_1_and_a_wrong_or_untagged_one_0(dataset):
    task = rg_task(dataset)
    for item in take(task, 0, "train", 10) + take(task, 0, "eval", 4):
        assert item.prompt.endswith("Give your final answer between <answer> and </answer> tags.")
        assert task.reward(item.prompt, f"Let me think.\n<answer>{item.answer}</answer>") == 1.0
        assert task.reward(item.prompt, f"<answer>{item.answer}</answer>") == 1.0
        assert task.demonstration(item) == f"<answer>{item.answer}</answer>"
        assert task.reward(item.prompt, task.demonstration(item)) == 1.0
        assert task.reward(item.prompt, "<answer>wrong</answer>") == 0.0
        assert task.reward(item.prompt, item.answer) == 0.0  # the right answer outside the stated format


@needs_rg
@pytest.mark.parametrize("dataset", ["chain_sum", "leg_counting"])
def test_the_boxed_format_is_asked_for_read_and_demonstrated_and_the_tags_no_longer_count(dataset):
    task = rg_task(dataset, rg_answer_format="boxed", apply_chat_template=True)
    for item in take(task, 0, "train", 10) + take(task, 0, "eval", 4):
        user = item.prompt[-1]["content"]
        assert user.endswith("\n\nPut the final answer in \\boxed{}.") and "<answer>" not in user
        assert task.demonstration(item) == f"\\boxed{{{item.answer}}}"
        assert task.reward(item.prompt, task.demonstration(item)) == 1.0
        # the last complete box counts, spaces stripped, inside $...$ too; an unclosed one is not read
        assert task.reward(item.prompt, f"So $\\boxed{{0}}$... no: $\\boxed{{ {item.answer} }}$ \\boxed{{9") == 1.0
        assert task.reward(item.prompt, f"\\boxed{{{item.answer}}} then \\boxed{{wrong}}") == 0.0
        assert task.reward(item.prompt, f"<answer>{item.answer}</answer>") == 0.0  # not the stated format
        assert task.reward(item.prompt, item.answer) == 0.0
    # the same items as the tags format, but for the instruction: the format changes no draw
    tags = rg_task(dataset, apply_chat_template=True)
    assert [i.answer for i in take(tags, 0, "train", 50)] == [i.answer for i in take(task, 0, "train", 50)]
    with pytest.raises(ConfigError, match=re.escape("task.rg_answer_format='json' is invalid; allowed: tags")):
        load_config(None, [f"task.name={NAME}", "task.rg_answer_format=json"])


@needs_rg
def test_an_answer_the_scorer_cannot_parse_scores_0_and_an_unknown_prompt_is_rejected():
    task = rg_task("prime_factorization")
    item = take(task, 0, "train", 1)[0]
    assert task.reward(item.prompt, task.demonstration(item)) == 1.0
    assert task.reward(item.prompt, "<answer>zzz</answer>") == 0.0  # its scorer raises ValueError on it
    with pytest.raises(RewardRejected, match="reward_raised.*not one of basic_arithmetic's items"):
        rg_task().reward("Calculate 1 + 1.", "<answer>2</answer>")


@needs_rg
def test_a_dataset_without_reference_answers_has_no_demonstration():
    task = rg_task("graph_color", rg_size=3, eval_prompts=1)
    assert task.demonstration is None and take(task, 0, "train", 1)[0].answer == ""


@needs_rg
def test_chat_prompts_are_a_user_turn_after_the_optional_system_prompt():
    from reasoning_gym.utils import SYSTEM_PROMPTS

    plain = take(rg_task(), 0, "train", 1)[0].prompt
    chat = rg_task(apply_chat_template=True)
    item = take(chat, 0, "train", 1)[0]
    assert item.prompt == [{"role": "user", "content": plain}]
    assert chat.reward(item.prompt, chat.demonstration(item)) == 1.0
    system = take(rg_task(apply_chat_template=True, rg_system_prompt="default"), 0, "train", 1)[0].prompt
    assert system == [{"role": "system", "content": SYSTEM_PROMPTS["default"]}, {"role": "user", "content": plain}]
    written = take(rg_task(rg_system_prompt="direct"), 0, "train", 1)[0].prompt
    assert written == f"{SYSTEM_PROMPTS['direct']}\n\n{plain}"


@needs_rg
@pytest.mark.parametrize("keys, message", [
    ({"rg_dataset": "basic_arithmetc"}, "config: task.rg_dataset='basic_arithmetc' is invalid; allowed: did you mean "
                                        r"'basic_arithmetic'\? one of reasoning-gym's .* datasets: .*chain_sum"),
    ({"rg_dataset": ""}, "config: task.rg_dataset='' is invalid; allowed: .*basic_arithmetic"),
    ({"rg_config": {"min_termz": 2}}, r"config: task.rg_config.min_termz=2 is invalid; allowed: a field of "
                                      r"basic_arithmetic's config \(BasicArithmeticDatasetConfig\): min_terms, "),
    ({"rg_config": {"min_terms": 0}}, r"config: task.rg_config=\{'min_terms': 0\} is invalid; allowed: a config "
                                      "basic_arithmetic accepts; it says AssertionError: min_terms must be positive"),
    ({"rg_system_prompt": "nope"}, "config: task.rg_system_prompt='nope' is invalid; allowed: one of 'DeepSeekZero'"),
    ({"rg_dataset": "ransom_note"}, "task.rg_dataset='ransom_note' is invalid; allowed: a dataset whose questions "
                                    "are the same in every process"),
])
def test_a_bad_dataset_config_or_system_prompt_fails_at_load_naming_the_key(keys, message):
    keys = {"rg_dataset": "basic_arithmetic", **keys}
    with pytest.raises(TaskError, match=message):
        load_task(NAME, TaskConfig(name=NAME, rg_size=5, **keys))


def test_config_keys_are_checked_before_any_task_loads():
    cfg = load_config("configs/tiny.yaml", [f"task.name={NAME}", "task.rg_dataset=chain_sum",
                                            "task.rg_config.min_terms=2", "task.rg_config.max_terms=3"])
    assert cfg.task.rg_config == {"min_terms": 2, "max_terms": 3} and cfg.task.rg_size == 10000
    for bad, key in ((["task.rg_config.seed=3"], "task.rg_config.seed=3 is invalid"),
                     (["task.rg_config.size=3"], "task.rg_config.size=3 is invalid"),
                     (["task.rg_size=0"], "task.rg_size=0 is invalid"),
                     (["task.rg_dataset=chain-sum"], "task.rg_dataset='chain-sum' is invalid")):
        with pytest.raises(ConfigError, match=re.escape(key)):
            load_config(None, bad)


def test_without_the_package_the_task_fails_at_load_with_the_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if not installed: its import fails
    with pytest.raises(TaskError, match=re.escape("needs the reasoning-gym package, which is not installed: "
                                                  "pip install reasoning-gym==0.1.25")):
        load_task(NAME, TaskConfig(name=NAME, rg_dataset="chain_sum"))


@needs_rg
def test_the_driver_path_opens_it_from_the_run_config_and_streams_scoreable_prompts():
    """As the Job does: load_config, then open_task(cfg.task, evaluate=...); the buffer's PromptStream
    and the warm start's (seed task.seed + 7919) serve the same items, every one scored by Task.reward."""
    cfg = load_config("configs/tiny.yaml", [f"task.name={NAME}", "task.rg_dataset=chain_sum", "task.rg_size=20",
                                            "task.eval_prompts=6", "task.rg_config.max_terms=3"])
    task = open_task(cfg.task, evaluate=True)
    assert task.name == NAME and task.demonstration is not None
    ev = take(task, cfg.task.seed, "eval", cfg.task.eval_prompts)
    assert len(ev) == 6
    stream, warm = PromptStream(task, cfg.task.seed), PromptStream(task, cfg.task.seed + 7919)
    served = [next(stream) for _ in range(40)]  # two epochs
    assert sorted(i.uid for i in served) == sorted(list(range(20)) * 2)
    assert {next(warm).uid for _ in range(20)} == set(range(20))
    for item in served[:20] + ev:
        assert task.reward(item.prompt, task.demonstration(item)) == 1.0
        assert task.reward(item.prompt, "<answer>-999999</answer>") == 0.0
