"""What a person watching a run sees: a quiet console (run.log_level), the trained samples in
out_dir/rollouts.jsonl and TensorBoard (run.log_rollouts), and W&B offline (run.wandb). A real CLI
run's console and rollouts.jsonl are checked in tests/test_finite_tasks.py (one run serves both).

    .venv/bin/python -m pytest -q tests/test_run_output.py
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys

import pytest

from pipeline import logs, procs
from pipeline.buffer import ReplayBufferCore
from pipeline.config import BufferConfig, ConfigError, load_config
from pipeline.driver.metrics import MetricsSink, read_jsonl, trained_samples
from pipeline.models.tiny import TINY_EOS_ID, TINY_PAD_ID
from pipeline.tokens import load_tokenizer
from pipeline.tasks import reverse
from pipeline.types import PromptItem, Rollout


def _batch(tok, version: int = 2):
    """A real buffer's batch of 2 groups x 2 samples of the reverse task, tokenised by the tiny tokenizer;
    prompts of different lengths (so rows are padded) and tokens from versions version-1 and version."""
    buf = ReplayBufferCore(BufferConfig(group_size=2, batch_groups=2, max_staleness=1, overcommit="none"), TINY_PAD_ID)
    buf.set_trainer_version(version)
    texts = {"rev abc=": [" cba", "ab"], "rev hgfed=": ["defgh", " x"]}
    for uid, (prompt, completions) in enumerate(texts.items()):
        gid = buf.admit(PromptItem(uid=uid, prompt=prompt)).group_id
        for i, c in enumerate(completions):
            ids = tuple(tok.encode(c, add_special_tokens=False)) + (TINY_EOS_ID,)
            vs = tuple([version - i] + [version] * (len(ids) - 1))  # sample 1 starts one version behind
            buf.add(Rollout(group_id=gid, sample_idx=i, prompt=prompt,
                            prompt_tokens=tuple(tok.encode(prompt, add_special_tokens=False)), completion=c,
                            completion_tokens=ids, logprobs=(-0.5,) * len(ids), versions=vs, finish_reason="stop",
                            reward=reverse.reward(prompt, c)))
    return buf.take_batch(), texts


def test_trained_samples_decode_prompt_completion_and_versions_of_a_padded_batch(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    batch, texts = _batch(tok)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731  (as Job.decode)
    rows = trained_samples(batch, decode, k=2, pad_id=TINY_PAD_ID)
    assert [r["group_id"] for r in rows] == [batch.group_ids[0], batch.group_ids[2]]  # spread over the groups
    for r in rows:
        assert r["completion"] == texts[r["prompt"]][0]  # rows 0 and 2: each group's first sample
        assert r["reward"] == pytest.approx(reverse.reward(r["prompt"], r["completion"]), abs=1e-6)
        assert r["versions"] == [2] * (len(tok.encode(r["completion"], add_special_tokens=False)) + 1)  # + EOS
        assert r["staleness"] == 0 and r["trainer_version"] == 2
    every = trained_samples(batch, decode, k=10, pad_id=TINY_PAD_ID)  # k > N: each row once
    assert [(r["prompt"], r["completion"]) for r in every] == [(p, c) for p, cs in texts.items() for c in cs]
    assert [r["staleness"] for r in every] == [0, 1, 0, 1] and every[1]["versions"][0] == 1
    assert trained_samples(batch, decode, k=0) == []


def test_rollouts_log_goes_to_jsonl_and_tensorboard_and_a_resume_does_not_repeat_rows(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    row = {"group_id": 0, "trainer_version": 0, "staleness": 0, "reward": 0.5, "advantage": 0.0,
           "prompt": "rev ab=", "completion": "ba", "versions": [0, 0]}
    sink = MetricsSink(tmp_path)
    for step in range(1, 5):
        sink.log_rollouts(step, [{**row, "trainer_version": step - 1}] * 2)
    sink.close()
    sink = MetricsSink(tmp_path, resume_step=2)  # the checkpoint was step 2: steps 3.. are redone
    for step in (3, 4):
        sink.log_rollouts(step, [{**row, "trainer_version": step - 1, "resumed": True}])
    sink.close()
    got = read_jsonl(tmp_path / "rollouts.jsonl")
    assert [(r["step"], r.get("resumed", False)) for r in got] == [(1, False)] * 2 + [(2, False)] * 2 + [
        (3, True), (4, True)]
    assert got[0] == {"step": 1, **row}
    acc = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    text = [e for e in acc.Tensors("rollouts/text_summary")]
    assert {e.step for e in text} == {1, 2, 3, 4}
    assert "'rev ab='" in text[0].tensor_proto.string_val[0].decode()
    MetricsSink(tmp_path).close()  # a fresh run in the same out_dir drops the old run's samples
    assert read_jsonl(tmp_path / "rollouts.jsonl") == []


def test_wandb_offline_writes_scalars_and_the_rollouts_table_under_out_dir_and_leaves_no_process(tmp_path):
    pytest.importorskip("wandb", reason="the wandb extra is not installed (pip install wandb)")
    row = {"group_id": 7, "trainer_version": 0, "staleness": 0, "reward": 0.25, "advantage": 1.0,
           "prompt": "rev abc=", "completion": "cbx", "versions": [0, 0, 0]}
    sink = MetricsSink(tmp_path, wandb="offline", config={"run": {"steps": 2}})
    sink.log(1, {"reward/mean": 0.25, "note": "not a scalar"})
    sink.log_rollouts(1, [row])
    sink.log(2, {"reward/mean": 0.5})
    sink.log_rollouts(2, [{**row, "completion": "cba", "reward": 1.0}])
    sink.close()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    history = next(run_dir.glob("run-*.wandb")).read_bytes()
    assert b"reward/mean" in history and b"not a scalar" not in history
    tables = [json.loads(p.read_text()) for p in run_dir.glob("files/media/table/rollouts_*.table.json")]
    logged = sorted(tuple(d) for t in tables for d in t["data"])
    assert tables[0]["columns"][:2] == ["step", "group_id"]
    assert [(d[0], d[7]) for d in logged] == [(1, "cbx"), (2, "cba")]  # (step, completion), once each
    assert not [c for pid, _ in procs.descendants(os.getpid()) if "wandb" in (c := _cmdline(pid))]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def test_wandb_without_the_package_fails_at_config_naming_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` sees when it is not installed
    with pytest.raises(ConfigError, match=r"run\.wandb='offline'.*pip install wandb"):
        load_config(None, ["run.wandb=offline"])
    assert load_config(None, ["run.wandb=off"]).run.wandb == "off"


def test_the_benign_rotary_reload_warning_is_dropped_at_warning_and_nothing_else():
    """The filter sits on the logger that emits the message, so it holds whatever vLLM does to its
    handlers; another layer's failed load and any error still get through, and info shows it again."""
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    seen: list[tuple[str, str]] = []
    handler = logging.Handler()
    # Monarch prefixes records made inside a Monarch process with "[actor=...] "; compare the message
    handler.emit = lambda r: seen.append((r.levelname, re.sub(r"^(\[actor=[^\]]*\] )+", "", r.getMessage())))
    logger.addHandler(handler)
    level = logger.level  # an earlier in-process engine may have raised vLLM's level: the filter is under test
    logger.setLevel(logging.DEBUG)
    try:
        logs.quiet_benign(logging.WARNING)
        for layer in ("RotaryEmbedding", "QKVParallelLinear"):
            logger.warning("%s: Failed to load weights", layer)
        logger.error("%s: Failed to load weights", "RotaryEmbedding")
        assert seen == [("WARNING", "QKVParallelLinear: Failed to load weights"),
                        ("ERROR", "RotaryEmbedding: Failed to load weights")]
        seen.clear()
        logs.quiet_benign(logging.INFO)
        logger.warning("%s: Failed to load weights", "RotaryEmbedding")
        assert seen == [("WARNING", "RotaryEmbedding: Failed to load weights")]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logs.quiet_benign(logging.INFO)
