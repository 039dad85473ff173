"""Durable state without meshes: atomic checkpoint directories, latest-finding, retention, the resume
fingerprint, the buffer's held groups across a restart, metrics rows across a resume, and the
trainer's RNG and config-owned hyper-parameters (pipeline/checkpoint.py).

    .venv/bin/python -m pytest -q tests/test_checkpoint.py
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline.buffer import ReplayBufferCore
from pipeline.checkpoint import (MARKER, Checkpoints, incomplete, latest, load_controller_state, prepare_resume,
                                 save_controller_state)
from pipeline.config import BufferConfig, ConfigError, load_config
from pipeline.driver.metrics import MetricsSink, read_jsonl
from pipeline.types import PromptItem, Rollout

from .conftest import REPO

TINY = REPO / "configs" / "tiny.yaml"


def tiny_cfg(out: Path, *overrides: str):
    return load_config(TINY, [f"run.out_dir={out}", *overrides])


def three_layers() -> str:
    """model.hf_dir=<a tiny checkpoint of another shape>: builtin:tiny with three layers."""
    from pipeline.models.tiny import TinySpec, ensure_tiny

    return f"model.hf_dir={ensure_tiny(TinySpec(n_layers=3), REPO / '.cache' / 'tiny-model')}"


def write_checkpoint(ck: Checkpoints, step: int, payload: bytes = b"x" * 1000) -> Path:
    """A checkpoint as the controller writes one, with a stand-in for the trainer's DCP files."""
    tmp = ck.begin(step)
    (tmp / "__0_0.distcp").write_bytes(payload)
    save_controller_state(tmp, {"step": step, "version": step})
    path = ck.commit(tmp, step, step)
    time.sleep(0.01)  # distinct marker times: newest = most recently written
    return path


def test_a_save_cut_short_is_never_resumed_and_latest_picks_the_previous_complete_one(tmp_path):
    cfg = tiny_cfg(tmp_path)
    ck = Checkpoints(cfg)
    good = write_checkpoint(ck, 2)
    truncated = write_checkpoint(ck, 4)
    with open(truncated / "__0_0.distcp", "r+b") as f:  # a file cut short after the marker was written
        f.truncate(10)
    killed = ck.begin(6)  # a save killed before its rename: step_6.tmp-<pid>, complete-looking inside
    (killed / "__0_0.distcp").write_bytes(b"x" * 1000)
    save_controller_state(killed, {"step": 6, "version": 6})
    unmarked = ck.root / "step_8"  # a step dir without its completion marker
    unmarked.mkdir()
    (unmarked / "__0_0.distcp").write_bytes(b"x" * 1000)

    assert "truncated" in incomplete(truncated) and MARKER in incomplete(unmarked)
    assert "not a step_N" in incomplete(killed)
    assert latest(ck.root) == good
    assert prepare_resume(load_config(TINY, [f"run.out_dir={tmp_path}", "run.resume=latest"])).run.resume == str(good)
    for bad in (truncated, unmarked, killed):
        with pytest.raises(ConfigError, match="run.resume"):
            prepare_resume(load_config(TINY, [f"run.out_dir={tmp_path}", f"run.resume={bad}"]))
    assert ck.sweep() == [killed] and not killed.exists()
    assert unmarked.exists()  # not a leftover of ours: skipped, never deleted


def test_resume_latest_without_a_checkpoint_is_a_config_error_naming_run_resume(tmp_path):
    with pytest.raises(ConfigError, match="run.resume='latest'"):
        prepare_resume(load_config(TINY, [f"run.out_dir={tmp_path}", "run.resume=latest"]))


def test_retention_keeps_only_the_newest_keep_checkpoints(tmp_path):
    ck = Checkpoints(tiny_cfg(tmp_path, "run.keep_checkpoints=2"))
    for step in (1, 2, 3, 4):
        write_checkpoint(ck, step)
    assert sorted(p.name for p in ck.root.iterdir()) == ["step_3", "step_4"]
    # a fresh run in the same out_dir: its checkpoints are the newest, whatever their step
    write_checkpoint(ck, 1)
    assert sorted(p.name for p in ck.root.iterdir()) == ["step_1", "step_4"] and latest(ck.root).name == "step_1"
    everything = Checkpoints(tiny_cfg(tmp_path / "all", "run.keep_checkpoints=0"))
    for step in (1, 2, 3):
        write_checkpoint(everything, step)
    assert len(list(everything.root.iterdir())) == 3


def test_resume_with_a_changed_shape_fails_naming_the_key_and_other_changes_apply(tmp_path, caplog):
    write_checkpoint(Checkpoints(tiny_cfg(tmp_path)), 2)
    resume = [f"run.out_dir={tmp_path}", "run.resume=latest"]
    for override, key in [(three_layers(), "model.hf_dir (num_hidden_layers in config.json)"),
                          ("buffer.batch_groups=4", "buffer.batch_groups"),
                          ("buffer.group_size=4", "buffer.group_size"),
                          ("task.name=pipeline.tasks.arith", "task.name")]:
        with pytest.raises(ConfigError, match=re.escape(key)):
            prepare_resume(load_config(TINY, [*resume, override]))
    with caplog.at_level(logging.INFO, logger="pipeline.checkpoint"):
        cfg = prepare_resume(load_config(TINY, [*resume, "trainer.lr=5e-4", "run.steps=900"]))
    assert cfg.trainer.lr == 5e-4 and cfg.run.steps == 900
    assert "trainer.lr=0.0005 (the checkpoint's run had 0.0003); the new value applies" in caplog.text
    assert prepare_resume(cfg) == cfg  # resolved once: idempotent
    with pytest.raises(ConfigError, match="run.steps=2 is invalid"):  # the checkpoint is at step 2
        prepare_resume(load_config(TINY, [*resume, "run.steps=2"]))


@pytest.mark.parametrize("override, key, old, new", [
    ("generator.temperature=0.7", "generator.temperature", "1.0", "0.7"),
    ("generator.logprobs_mode=raw", "generator.logprobs_mode", "'processed'", "'raw'"),
    ("model.dtype=bfloat16", "model.dtype", "'float32'", "'bfloat16'"),
])
def test_resume_with_another_sampling_temperature_logprobs_mode_or_dtype_is_refused(tmp_path, override, key, old, new):
    """The learner scores softmax(logits / temperature) in model.dtype, as the checkpoint's sampler
    did for the buffer it holds: a resume that changes either is refused, naming the key, the
    checkpoint's value and this config's."""
    write_checkpoint(Checkpoints(tiny_cfg(tmp_path)), 2)
    with pytest.raises(ConfigError) as e:
        prepare_resume(load_config(TINY, [f"run.out_dir={tmp_path}", "run.resume=latest", override]))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"config: {key} does not match the checkpoint")
    assert f"{key} is {new} here, {old} in the checkpoint" in msg


def test_a_checkpoint_without_the_sampling_fingerprint_is_checked_against_its_recorded_config(tmp_path):
    """A marker whose fingerprint predates generator.temperature, generator.logprobs_mode and
    model.dtype: the values its recorded config holds are the checkpoint's."""
    path = write_checkpoint(Checkpoints(tiny_cfg(tmp_path)), 2)
    marker = json.loads((path / MARKER).read_text())
    for key in ("generator.temperature", "generator.logprobs_mode", "model.dtype"):
        del marker["fingerprint"][key]
    (path / MARKER).write_text(json.dumps(marker))
    resume = [f"run.out_dir={tmp_path}", "run.resume=latest"]
    assert prepare_resume(load_config(TINY, resume)).run.resume == str(path)
    with pytest.raises(ConfigError, match=r"generator\.temperature is 0\.7 here, 1\.0 in the checkpoint"):
        prepare_resume(load_config(TINY, [*resume, "generator.temperature=0.7"]))


def test_a_tiny_model_checkpoint_from_before_builtin_tiny_resumes_as_builtin_tiny(tmp_path):
    """Before builtin:tiny an empty model.hf_dir was the tiny model: the marker recorded model.tiny.* and
    model.cache_dir, and named the tokenizer by a hash of its vocabulary, not of its files."""
    from pipeline.models.tiny import vocabulary_hash

    path = write_checkpoint(Checkpoints(tiny_cfg(tmp_path)), 2)
    marker = json.loads((path / MARKER).read_text())
    marker["fingerprint"]["tokenizer"] = vocabulary_hash()
    marker["config"]["model"] = {"hf_dir": "", "cache_dir": ".cache/tiny-model", "dtype": "float32",
                                 "tiny": {"seed": 0, "dim": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                                          "ffn_dim": 256, "max_seq_len": 256}}
    (path / MARKER).write_text(json.dumps(marker))
    resume = [f"run.out_dir={tmp_path}", "run.resume=latest"]
    assert prepare_resume(load_config(TINY, resume)).run.resume == str(path)
    with pytest.raises(ConfigError, match=re.escape("model.hf_dir (num_hidden_layers in config.json)")):
        prepare_resume(load_config(TINY, [*resume, three_layers()]))


@pytest.mark.parametrize("override,needle", [
    ("generator.temperature=0.7", "generator.temperature is 0.7 here, 1.0 in the checkpoint"),
    ("three layers", "model.hf_dir (num_hidden_layers in config.json)")], ids=["temperature", "model_shape"])
def test_cli_resume_with_another_fingerprinted_key_exits_2_before_any_mesh_starts(tmp_path, override, needle):
    write_checkpoint(Checkpoints(tiny_cfg(tmp_path)), 2)
    override = three_layers() if override == "three layers" else override
    p = subprocess.run([sys.executable, "-m", "pipeline.run", "--config", str(TINY), f"run.out_dir={tmp_path}",
                        "run.resume=latest", override], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    assert needle in p.stderr and "mesh" not in p.stderr


# ---------------------------------------------------------------------- the buffer's held groups


def rollout(gid: int, idx: int, reward: float, n: int = 3) -> Rollout:
    return Rollout(group_id=gid, sample_idx=idx, prompt="p", prompt_tokens=(5, 6), completion="c",
                   completion_tokens=(10,) * n, logprobs=(-0.5,) * n, versions=(0,) * n, finish_reason="stop",
                   reward=reward)


def test_buffer_round_trip_trains_the_complete_groups_and_requeues_the_in_flight_ones(tmp_path):
    bcfg = BufferConfig(group_size=2, batch_groups=2, max_staleness=1, overcommit="fixed", delta=2)
    buf = ReplayBufferCore(bcfg, 0)
    gids = [buf.admit(PromptItem(uid=i, prompt=f"p{i}")).group_id for i in range(4)]
    for gid in gids[:3]:  # three complete groups (more than a batch), one half-generated
        buf.add(rollout(gid, 0, 0.0))
        buf.add(rollout(gid, 1, float(gid + 1)))
    buf.add(rollout(gids[3], 0, 1.0))
    want = buf.take_batch()
    held = buf.stats()["held_samples"]
    # through torch.save, as controller_state.pt stores it
    save_controller_state(tmp_path, {"buffer": buf.state_dict()})
    new = ReplayBufferCore(bcfg, 0)
    new.load_state_dict(load_controller_state(tmp_path)["buffer"])

    assert new.check_accounting() == buf.check_accounting()
    assert new.stats()["held_samples"] == held and not new.dropped_groups
    assert new.requeued_groups == 1 and new.wasted_tokens == 3  # the half-generated group starts over
    assert new.has_requeued() and new.take_requeued((7, 0)).group_id == gids[3]
    for s in (0, 1):
        new.add(dataclasses.replace(rollout(gids[3], s, float(s)), generator_id=7))
    new.set_trainer_version(1)  # the next step: get_batch at version 1
    batch = new.take_batch()  # the saved complete group first, then the regenerated one
    assert batch.group_ids == (gids[2], gids[2], gids[3], gids[3])
    assert batch.advantages[:2].tolist() == pytest.approx([-0.7071, 0.7071], abs=1e-3)
    assert want.group_ids == (gids[0], gids[0], gids[1], gids[1])
    new.check_accounting()
    new.set_trainer_version(2)
    assert new.admit(PromptItem(uid=9, prompt="p9")).group_id == 4  # ids continue, no collision


# ---------------------------------------------------------------------- metrics


def test_metrics_after_a_resume_have_no_duplicate_steps(tmp_path):
    sink = MetricsSink(tmp_path)
    for step in range(0, 6):
        sink.log(step, {"reward/mean": 0.1 * step})
    sink.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "rew')  # torn last line of a killed run
    sink = MetricsSink(tmp_path, resume_step=3)  # the checkpoint was step 3: rows 4.. are redone
    for step in (4, 5, 6):
        sink.log(step, {"reward/mean": 1.0})
    sink.close()
    steps = [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")]
    assert steps == [0, 1, 2, 3, 4, 5, 6]
    MetricsSink(tmp_path).close()  # a fresh run in the same out_dir starts the file anew
    assert read_jsonl(tmp_path / "metrics.jsonl") == []


# ---------------------------------------------------------------------- trainer RNG and hyper-parameters


def test_trainer_restores_rng_per_rank_and_takes_the_new_lr(tmp_path):
    from pipeline.config import Config, ModelConfig, TrainerConfig
    from pipeline.models.tiny import ensure_tiny
    from pipeline.trainer.step import TrainCore

    mc = ModelConfig(hf_dir=str(ensure_tiny(cache_dir=REPO / ".cache" / "tiny-model")))
    a = TrainCore.from_config(Config(model=mc, trainer=TrainerConfig(lr=1e-3, warmup_steps=4)))
    a.optimizer.step()  # no gradients: the weights stay; the schedule moves one step into the warm-up
    a.scheduler.step()
    a.skipped_steps = 2  # the run's total of skipped steps goes on after a resume
    random.seed(123)
    torch.manual_seed(456)
    a.save(tmp_path / "ckpt")
    want = (random.random(), torch.rand(3))
    random.seed(0)
    b = TrainCore.from_config(Config(model=mc, trainer=TrainerConfig(lr=5e-4, warmup_steps=4)))  # seeds torch itself
    b.load(tmp_path / "ckpt")
    got = (random.random(), torch.rand(3))
    assert got[0] == want[0] and torch.equal(got[1], want[1])
    assert b.skipped_steps == 2 and b.scheduler.last_epoch == 1
    assert b.optimizer.param_groups[0]["lr"] == pytest.approx(5e-4 * 2 / 5)  # the new lr, the saved schedule
    assert json.loads((tmp_path / "ckpt" / "trainer_state.json").read_text())["version"] == 0
