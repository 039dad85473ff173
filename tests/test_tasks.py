import textwrap

import pytest

from pipeline.tasks import PromptStream, TaskError, load_task, take


BUILTIN = ["pipeline.tasks.reverse", "pipeline.tasks.arith", "pipeline.tasks.sort", "pipeline.tasks.boxed",
           "pipeline.tasks.rotate"]


@pytest.mark.parametrize("name", BUILTIN)
def test_builtin_task_demonstrations_score_one_and_junk_scores_less(name):
    task = load_task(name)
    for item in take(task, seed=3, split="train", n=20):
        assert task.reward(item.prompt, task.demonstration(item)) == 1.0
        assert task.reward(item.prompt, "") == 0.0


def test_reverse_gives_partial_credit():
    task = load_task("pipeline.tasks.reverse")
    assert task.reward("rev abcd=", "dcba") == 1.0
    assert task.reward("rev abcd=", "dcbx") == pytest.approx(0.75)
    assert task.reward("rev abcd=", "dcbaaaaa") == pytest.approx(0.5)


def test_arith_gives_partial_credit():
    task = load_task("pipeline.tasks.arith")
    assert task.reward("12+7=", "19") == 1.0
    assert 0 < task.reward("12+7=", "29") < 1
    assert task.reward("12+7=", "x") == 0.0


def test_sort_gives_partial_credit():
    task = load_task("pipeline.tasks.sort")
    assert task.reward("sort dbca=", "abcd") == 1.0
    assert task.reward("sort dbca=", "abdc") == pytest.approx(0.5)
    assert task.reward("sort dbca=", "dcba") == 0.0  # reversing is not sorting


def test_boxed_rewards_the_format_and_the_sum():
    task = load_task("pipeline.tasks.boxed")
    assert task.reward("box 12+7=", "(19)") == 1.0
    assert task.reward("box 12+7=", "(29)") == pytest.approx(0.3 + 0.7 * 0.45)  # format, one digit of two
    assert task.reward("box 12+7=", "19") == pytest.approx(0.3)  # right sum, no format
    assert task.reward("box 12+7=", "(x)") == 0.0 and task.reward("box 12+7=", "()") == 0.0
    with pytest.raises(Exception, match="malformed"):
        task.reward("12+7=", "(19)")


def test_builtin_tasks_are_tokenizable_by_the_tiny_model():
    from pipeline.models.tiny import CHARS

    for name in BUILTIN:
        task = load_task(name)
        for item in take(task, 0, "train", 50) + take(task, 0, "eval", 50):
            assert set(item.prompt + task.demonstration(item)) <= set(CHARS), (name, item.prompt)


def test_train_and_eval_prompt_streams_differ():
    task = load_task("pipeline.tasks.reverse")
    train = {i.prompt for i in take(task, 0, "train", 50)}
    evals = [i.prompt for i in take(task, 0, "eval", 50)]
    assert len(train.intersection(evals)) < 25


def test_task_plugin_loads_from_outside_the_package(tmp_path, monkeypatch):
    (tmp_path / "my_user_task.py").write_text(textwrap.dedent('''
        from pipeline.types import PromptItem
        def prompts(seed, split):
            i = 0
            while True:
                yield PromptItem(uid=i, prompt=f"say {i}=", answer=str(i)); i += 1
        def reward(prompt, completion):
            return float(completion.strip() == prompt[4:-1])
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    task = load_task("my_user_task")
    assert task.reward("say 7=", "7") == 1.0 and task.reward("say 7=", "8") == 0.0
    assert [i.prompt for i in take(task, 0, "train", 2)] == ["say 0=", "say 1="]
    assert task.demonstration is None


@pytest.mark.parametrize("path, msg", [
    ("no_such_pkg_xyz.task", "no module"),
    ("pipeline.tasks.nothing_here", "no attribute"),
    ("pipeline.types", "missing callable"),
])
def test_bad_task_path_is_a_clear_error(path, msg):
    with pytest.raises(TaskError, match=msg):
        load_task(path)


def test_prompt_stream_position_is_checkpointable():
    task = load_task("pipeline.tasks.arith")
    s = PromptStream(task, seed=5)
    first = [next(s) for _ in range(7)]
    state = s.state_dict()
    expected = [next(s) for _ in range(5)]
    s2 = PromptStream(task, seed=5)
    s2.load_state_dict(state)
    assert [next(s2) for _ in range(5)] == expected
    assert first[0].uid == 0 and expected[0].uid == 7


def test_calc_tool_task_episode_and_reward():
    from pipeline.models.tiny import CHARS

    task = load_task("pipeline.tasks.calc")
    for item in take(task, seed=3, split="train", n=20):
        demo = task.demonstration(item)  # model turn, observation, model turn
        env = task.env(item)
        assert env.step(demo[0]) == demo[1]  # the tool call gets the observation the demo shows
        assert env.step(demo[2]) is None  # a final answer ends the episode
        assert task.reward(item.prompt, "".join(demo)) == 1.0
        assert set(item.prompt + "".join(demo)) <= set(CHARS)
    env = task.env(take(task, 0, "train", 1)[0])
    assert env.step("?12*") == ":error;" and env.step("?2**99") == ":error;"  # a tool error is an observation
    assert env.step("?08*3") == ":24;" and env.step("?2+3*4-5") == ":9;" and env.step("? 7 ") == ":7;"
    item = take(task, 0, "train", 1)[0]
    assert task.env(item).step("?") == task.env(item).step("?" + item.prompt[4:-1])  # bare: the question
    assert task.reward("mul 12*3=", "?12*3:36;36") == 1.0
    assert task.reward("mul 12*3=", "?12*3:36;") == 0.0  # no final answer after the tool's result
    assert 0 < task.reward("mul 12*3=", "?12*3:36;16") < 1


def test_rotate_pays_the_exact_answer_or_nothing():
    task = load_task("pipeline.tasks.rotate")
    assert task.reward("rot abcd=", "bcda") == 1.0 and task.reward("rot abcd=", " bcda ") == 1.0
    assert task.reward("rot abcd=", "bcdx") == 0.0 and task.reward("rot abcd=", "bcdaa") == 0.0
    assert task.reward("rot abcd=", "dcba") == 0.0  # reversing is not rotating
    assert [i.prompt for i in take(task, 0, "train", 5)] != [i.prompt for i in take(task, 0, "eval", 5)]
    with pytest.raises(ValueError, match="malformed"):
        task.reward("rev abc=", "bca")


def test_lookup_tool_task_answer_must_be_copied_from_the_tool():
    from pipeline.models.tiny import CHARS
    from pipeline.tasks.lookup import code_of

    task = load_task("pipeline.tasks.lookup")
    items = take(task, seed=3, split="train", n=50)
    for item in items:
        demo = task.demonstration(item)  # model turn, observation, model turn
        env = task.env(item)
        assert env.step(demo[0]) == demo[1] == f":{item.answer};"  # the tool gives the answer
        assert env.step(demo[2]) is None  # a final answer ends the episode
        assert task.reward(item.prompt, "".join(demo)) == 1.0
        assert set(item.prompt + "".join(demo)) <= set(CHARS)
    assert len({i.answer for i in items}) > 30  # a table, not a rule the model could learn
    assert code_of("abc") == code_of("abc") == task.env(items[0]).step("?abc")[1:-1]  # any key, fixed codes
    env = task.env(items[0])
    assert env.step("?ab") == ":error;" and env.step("?ABC") == ":error;" and env.step("? abc ") == f":{code_of('abc')};"
    code = code_of("qmz")
    assert task.reward("key qmz=", f"?:{code};{code}") == 1.0
    assert task.reward("key qmz=", f"?:{code};") == 0.0  # called the tool, did not use its answer
    assert task.reward("key qmz=", code) == 1.0  # a guess that happens to be right pays too
    assert 0 < task.reward("key qmz=", f"?:{code};{code[:2]}0" if code[2] != "0" else f"?:{code};{code[:2]}1") < 1


def test_env_is_a_plug_in_by_dotted_path():
    from pipeline.config import TaskConfig

    task = load_task("pipeline.tasks.reverse", TaskConfig(name="pipeline.tasks.reverse", env="pipeline.tasks.calc.env"))
    assert task.env is not None and task.reward("rev ab=", "ba") == 1.0  # the task's prompts and reward stay
    assert load_task("pipeline.tasks.reverse").env is None  # single-turn unless asked
    with pytest.raises(TaskError, match="no attribute"):
        load_task("pipeline.tasks.reverse", TaskConfig(name="pipeline.tasks.reverse", env="pipeline.tasks.calc.nope"))
    with pytest.raises(TaskError, match="not callable"):
        load_task("pipeline.tasks.reverse", TaskConfig(name="pipeline.tasks.reverse", env="pipeline.tasks.calc.CALL"))
