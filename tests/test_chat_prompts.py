"""The path a real user takes: a Qwen3 checkpoint with its real tokenizer, chat prompts, special ids
read from the checkpoint's files (pipeline/tokens.py). The tiny model's ids stay what they were; a
shrunk Qwen3 (2 layers, Qwen's real tokenizer and chat template, eos 151645 `<|im_end|>`, pad 151643
`<|endoftext|>`, where id 2 is `#`) gets its own everywhere: the generators' prompt tokens and stop
set, the warm start's demonstrations, the multi-turn layout, the buffer's padding; one short real
CLI run trains on chat prompts from a JSONL file.

    .venv/bin/python -m pytest -q tests/test_chat_prompts.py -m "not slow"   # seconds, no engine
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from pipeline.buffer import ReplayBufferCore
from pipeline.config import BufferConfig, Config, ConfigError, ModelConfig, TaskConfig
from pipeline.driver.warm_start import demo_batch
from pipeline.generator.core import GeneratorCore
from pipeline.models.tiny import TINY_BOS_ID, TINY_EOS_ID, TINY_PAD_ID
from pipeline.models.qwen3_tokenizer import ENDOFTEXT_ID, IM_END_ID
from pipeline.models.qwen3_checkpoint import ensure_checkpoint, qwen3_config
from pipeline.tasks import TaskError, load_task, open_task, take
from pipeline.tokens import PromptError, SpecialTokens, encode_completion, encode_prompt, load_tokenizer
from pipeline.types import ENV_VERSION, PromptGroup, PromptItem, Rollout

from .conftest import REPO

SMALL = dict(layers=2, hidden=64, ffn=128, heads=2, kv_heads=1)
THINK_OFF = [151667, 271, 151668, 271]  # "<think>\n\n</think>\n\n": Qwen3's template with enable_thinking=false
WORDS = ["abc", "bad", "cab", "dab", "fed", "gag", "hag", "ace"]


def chat(word: str) -> list[dict]:
    return [{"role": "system", "content": "Reverse the word."}, {"role": "user", "content": word}]


def chat_file(path: Path) -> Path:
    path.write_text("".join(json.dumps({"id": w, "messages": chat(w), "answer": w[::-1]}) + "\n" for w in WORDS))
    return path


@pytest.fixture(scope="session")
def qwen_dir() -> Path:
    return ensure_checkpoint(qwen3_config(**SMALL), seed=0, cache_dir=REPO / ".cache" / "qwen3")


@pytest.fixture(scope="session")
def qwen_tok(qwen_dir):
    return load_tokenizer(qwen_dir)


def generator_for(cfg: Config, tok) -> GeneratorCore:
    """A GeneratorCore with its tokenizer and no engine: prompt tokens and multi-turn layout need no vLLM."""
    core = GeneratorCore(cfg, 0)
    core.engine.tok, core.engine.special = tok, SpecialTokens.of(tok)
    return core


def test_special_ids_come_from_the_checkpoint_files(tiny_dir, qwen_tok):
    tiny = SpecialTokens.of(load_tokenizer(tiny_dir))
    assert (tiny.eos, tiny.pad, tiny.bos, tiny.stop) == (TINY_EOS_ID, TINY_PAD_ID, TINY_BOS_ID, (TINY_EOS_ID,))
    q = SpecialTokens.of(qwen_tok)
    assert (q.eos, q.pad, q.bos, q.stop) == (IM_END_ID, ENDOFTEXT_ID, None, (IM_END_ID, ENDOFTEXT_ID))
    assert qwen_tok.decode([TINY_EOS_ID]) == "#"  # what ending a turn with the tiny model's constant wrote


@pytest.mark.parametrize("thinking", [None, False])
def test_warm_start_demo_rows_end_model_turns_with_the_checkpoints_eos_and_pad_with_its_pad(
        qwen_dir, qwen_tok, tmp_path, thinking):
    """Chat prompts rendered once by the template, the same in the generators and the warm start;
    each demonstrated turn ends with <|im_end|> (151645), rows are padded with <|endoftext|> (151643)."""
    tc = TaskConfig(name="pipeline.tasks.jsonl", path=str(chat_file(tmp_path / "chat.jsonl")), eval_prompts=0,
                    enable_thinking=thinking)
    cfg = Config(model=ModelConfig(hf_dir=str(qwen_dir)), task=tc)
    core, task = generator_for(cfg, qwen_tok), open_task(tc, evaluate=False)
    items = take(task, 0, "train", len(WORDS))
    ids, mask = demo_batch(qwen_tok, task, items, thinking)
    rendered = qwen_tok.apply_chat_template(chat("abc"), tokenize=False, add_generation_prompt=True,
                                            **({} if thinking is None else {"enable_thinking": thinking}))
    for row, m, item in zip(ids.tolist(), mask.tolist(), items):
        start, n = m.index(1.0), int(sum(m))
        prompt = list(core.episodes.prompt_tokens(item.prompt))
        assert row[:start] == prompt == encode_prompt(qwen_tok, item.prompt, thinking)
        assert prompt[-4:] == THINK_OFF if thinking is False else prompt[-4:] != THINK_OFF
        assert row[start:start + n] == encode_completion(qwen_tok, item.answer) + [IM_END_ID]
        assert set(row[start + n:]) <= {ENDOFTEXT_ID} and TINY_EOS_ID not in row
    assert qwen_tok.decode(encode_prompt(qwen_tok, chat("abc"), thinking)) == rendered
    assert task.reward(chat("abc"), "cba") == 1.0  # the reward gets the messages as the task gave them


class ChatCalc:
    """A multi-turn chat task: one call of a scripted calculator, then the answer."""

    @staticmethod
    def prompts(seed, split):
        return [PromptItem(uid=0, prompt=[{"role": "user", "content": "mul 37*4="}], answer="148")]

    @staticmethod
    def reward(prompt, completion):
        return float(completion == "?:148;148")

    @staticmethod
    def demonstration(item):
        return ["?", ":148;", "148"]

    @staticmethod
    def env(item):
        return types.SimpleNamespace(step=lambda turn: ":148;" if turn == "?" else None)


@pytest.mark.parametrize("cut", [False, True])
def test_a_chat_observation_is_a_user_turn_the_same_in_generation_and_warm_start(qwen_dir, qwen_tok, cut):
    """Token in, token out: the generator's rollout (scripted model turns) and the warm start's demo
    row are the same tokens: prompt, `?<|im_end|>`, `\\n<|im_start|>user\\n:148;<|im_end|>\\n<|im_start|>
    assistant\\n`, `148<|im_end|>`. A turn cut by its budget (no <|im_end|>) gets the frame's own; the
    reward reads `?:148;148`, frame and special tokens left out."""
    cfg = Config(model=ModelConfig(hf_dir=str(qwen_dir)),
                 task=TaskConfig(name=f"{__name__}.ChatCalc", max_turns=3, max_total_tokens=64, max_obs_tokens=16))
    core, task = generator_for(cfg, qwen_tok), load_task(cfg.task.name, cfg.task)
    eps = core.episodes
    item = ChatCalc.prompts(0, "train")[0]
    turns = iter([encode_completion(qwen_tok, "?") + ([] if cut else [IM_END_ID]),
                  encode_completion(qwen_tok, "148") + [IM_END_ID]])

    async def turn(t):
        ids = next(turns)
        t.extend(ids, [-0.5] * len(ids), [0] * len(ids))
        return "length" if cut and t.turns == 0 else "stop"

    from pipeline.generator.trajectory import Trajectory

    traj = Trajectory(PromptGroup(0, item, 1, 0), 0, eps.prompt_tokens(item.prompt))
    asyncio.run(eps.play(traj, turn, eps.env_calls))
    ids, mask = demo_batch(qwen_tok, task, [item])
    assert traj.context() == ids[0].tolist()  # the whole row, the frame's <|im_end|> included either way
    model = [1.0 if v != ENV_VERSION else 0.0 for v in traj.versions]
    demo_mask = mask[0, len(traj.prompt_tokens):].tolist()
    k = 1 if cut else 0  # cut: the <|im_end|> after `?` is the environment's, not a trained model token
    assert model == demo_mask[:1] + [0.0] * k + demo_mask[1 + k:] if cut else model == demo_mask
    env = qwen_tok.decode([t for t, v in zip(traj.tokens, traj.versions) if v == ENV_VERSION])
    assert env == ("<|im_end|>" if cut else "") + "\n<|im_start|>user\n:148;<|im_end|>\n<|im_start|>assistant\n"
    assert eps.transcript(traj) == "?:148;148" and task.reward(item.prompt, eps.transcript(traj)) == 1.0


def test_chat_prompts_round_trip_through_the_buffer_state_and_pad_with_the_checkpoints_pad(qwen_tok):
    """Prompts held in the buffer are saved in checkpoints (pickled): messages come back as they went;
    the batch's rows are padded with the checkpoint's pad, 151643 for Qwen3."""
    pad = SpecialTokens.of(qwen_tok).pad
    cfg = BufferConfig(group_size=2, batch_groups=2, max_staleness=1, overcommit="none")
    buf = ReplayBufferCore(cfg, pad)
    done, flying = (buf.admit(PromptItem(uid=i, prompt=chat(w), answer=w[::-1])) for i, w in enumerate(["abc", "hgf"]))
    rows = [encode_completion(qwen_tok, c) + [IM_END_ID] for c in ("cba", "c b a")]

    def finish(b: ReplayBufferCore, g: PromptGroup) -> None:
        for i, c in enumerate(rows):
            b.add(Rollout(group_id=g.group_id, sample_idx=i, prompt=g.item.prompt,
                          prompt_tokens=tuple(encode_prompt(qwen_tok, g.item.prompt)), completion="",
                          completion_tokens=tuple(c), logprobs=(-0.5,) * len(c), versions=(0,) * len(c),
                          finish_reason="stop", reward=float(i)))

    finish(buf, done)
    saved = io.BytesIO()
    torch.save(buf.state_dict(), saved)  # as a checkpoint holds it (pipeline/checkpoint.py)
    saved.seek(0)
    again = ReplayBufferCore(cfg, pad)
    again.load_state_dict(torch.load(saved, weights_only=False))
    requeued = again.take_requeued((0, 0))
    assert requeued.item.prompt == flying.item.prompt == chat("hgf")
    finish(again, requeued)
    batch = again.take_batch()
    want = [encode_prompt(qwen_tok, chat(w)) + c for w in ("abc", "hgf") for c in rows]
    t = max(map(len, want))
    assert len({len(w) for w in want}) > 1  # some rows are padded
    assert batch.input_ids.tolist() == [w + [ENDOFTEXT_ID] * (t - len(w)) for w in want]


@pytest.mark.parametrize("line, why", [
    ('{"messages": [{"role": "user"}], "answer": "b"}', "'messages': message 0 has no 'content'"),
    ('{"messages": [{"content": "a"}], "answer": "b"}', "'messages': message 0 has no 'role'"),
    ('{"messages": [], "answer": "b"}', "'messages': the prompt is an empty list of messages"),
    ('{"messages": "hi", "answer": "b"}', "'messages': a prompt is a str or a list of messages, got str"),
    ('{"messages": [{"role": "user", "content": 3}], "answer": "b"}', "'content' must be a string, got int"),
    ('{"prompt": "a", "messages": [], "answer": "b"}', "both 'prompt' and 'messages'"),
    ('{"answer": "b"}', r"missing key\(s\) 'prompt' \(or 'messages', a chat prompt\)"),
])
def test_a_bad_chat_prompt_fails_at_load_naming_file_line_and_what_is_wrong(tmp_path, line, why):
    f = tmp_path / "data.jsonl"
    f.write_text(json.dumps({"messages": chat("x"), "answer": "y"}) + "\n\n" + line + "\n")
    with pytest.raises(TaskError, match=f"{re.escape(str(f))}:3: .*{why}"):
        load_task("pipeline.tasks.jsonl", TaskConfig(name="pipeline.tasks.jsonl", path=str(f)))


def test_chat_prompts_for_a_checkpoint_without_a_chat_template_are_a_config_error_naming_it(tiny_dir, tmp_path):
    from pipeline.driver.job import Job

    tok = load_tokenizer(tiny_dir)
    with pytest.raises(PromptError, match=f"tokenizer of {re.escape(str(tiny_dir))} has no chat template"):
        encode_prompt(tok, chat("abc"))
    cfg = Config(task=TaskConfig(name="pipeline.tasks.jsonl", path=str(chat_file(tmp_path / "c.jsonl")),
                                 eval_prompts=0))
    job = Job(cfg)
    job.tokenizer = tok
    with pytest.raises(ConfigError, match=f"cannot be used with model {re.escape(str(tiny_dir))}: its first "
                                          "prompt: the prompt is a list of messages, but the tokenizer"):
        job.check_prompts()


@pytest.mark.slow
def test_cli_run_on_a_qwen3_checkpoint_with_chat_prompts(qwen_dir, qwen_tok, tmp_path):
    """The shrunk Qwen3 (bf16, Qwen's tokenizer) on a JSONL file of chat prompts, through the CLI with a
    warm start: it ends (exit 0, 3 steps), and the logged samples' prompts are the chat rendering
    (the template's text; the CLI decodes without special tokens) of the file's messages. Its pushes
    go over rdma with `weight_sync.verify=every` (shm is the qwen2 family's verified CLI run, collective
    the two-rank one of tests/test_verify.py): every push is served bit for bit, and the
    sampler/learner mismatch per step is bf16 noise."""
    data = chat_file(tmp_path / "chat.jsonl")
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "pipeline.run", "--config", "configs/tiny.yaml",
                        f"model.hf_dir={qwen_dir}", "model.dtype=bfloat16", "task.name=pipeline.tasks.jsonl",
                        f"task.path={data}", "task.eval_prompts=0", "run.eval_every=0", "run.steps=3",
                        "run.warm_start_steps=1", "run.checkpoint_every=0", "buffer.batch_groups=2",
                        "buffer.group_size=2", "generator.concurrency=4", "generator.max_new_tokens=6",
                        "weight_sync.transport=rdma", "weight_sync.verify=every", f"run.out_dir={out}"],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-6000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3
    assert summary["pushes"]["started"] == summary["pushes"]["verified"] >= 3, summary["pushes"]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in steps if "mismatch_max" in r]
    assert len(steps) == 3
    for r in steps:  # bf16 engines against a bf16 forward of the same weights
        assert r["mismatch_cur_frac"] + r["mismatch_stale_frac"] == pytest.approx(1.0)
        assert r["mismatch_max"] < 0.1 and abs(r["kl_sampler_learner"]) < 0.02, r
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) == 3 * 2
    shown = {qwen_tok.decode(encode_prompt(qwen_tok, chat(w)), skip_special_tokens=True): w for w in WORDS}
    assert all(r["prompt"] in shown for r in rows), [r["prompt"] for r in rows]
    assert next(iter(shown)) == "system\nReverse the word.\nuser\nabc\nassistant\n"
