"""Durable checkpoints: atomic step directories, retention, the newest complete one, and the
fingerprint a resume must match.

    ck = Checkpoints(cfg)                    # out_dir/checkpoints, keeping run.keep_checkpoints
    ck.sweep()                               # at start: remove what a killed save left behind
    tmp = ck.begin(step)                     # a fresh step_N.tmp-<pid>-<k>
    ...                                      # every trainer rank writes its part into tmp, then the
                                             # controller writes controller_state.pt
    path = ck.commit(tmp, step, version)     # marker written last, os.replace -> step_N, retention
    cfg = prepare_resume(cfg)                # at start-up (pipeline/run.py): run.resume=latest -> a path,
                                             # an incomplete one refused, the fingerprint checked

A checkpoint directory out_dir/checkpoints/step_N/ holds
    .metadata, __<r>_0.distcp   trainer model + AdamW moments (torch.distributed.checkpoint, all ranks)
    trainer_state.json          version, LR schedule, optimizer hyper-parameters (trainer rank 0)
    rng_rank<r>.pt              torch and python RNG of trainer rank r
    controller_state.pt         step, version, the buffer (held groups with their rollouts, counters,
                                prompt position), the eval curve, the controller's RNG
    COMPLETE.json               the completion marker, written last: step, version, fingerprint,
                                the run's config and every other file's size

Atomicity: a directory is complete iff it is named step_N and its COMPLETE.json parses and lists
every file at its recorded size. Writers fill step_N.tmp-<pid>-<k> and the controller renames it only
after every trainer rank has returned and the (fsync'd) marker is on disk, so a save killed at any
point leaves the previous checkpoints intact plus a tmp directory that is never resumed and is swept
at the next start. A step_N without its marker or with a truncated file is skipped by `latest`.

Newest means most recently written (the marker's time, then the step): a fresh run in an out_dir
that holds an earlier run's checkpoints makes its own the newest, and retention (keep the
run.keep_checkpoints newest complete ones; 0 keeps all) removes the old ones as it goes.

Fingerprint: what a resume must match, else a ConfigError naming the key before any mesh starts:
the model (every config.json field its family reads: shape, norm epsilon, RoPE, bias, tying; from
model.hf_dir's config.json), the tokenizer (a hash of its files), task.name,
buffer.batch_groups and buffer.group_size, and what the learner scores the sampler's tokens with:
generator.temperature, generator.logprobs_mode and model.dtype (the buffer a checkpoint holds was
sampled and scored with them; a checkpoint whose fingerprint lacks them is checked against the config
it recorded). Any other key may change on resume (trainer.lr, run.steps, ...): the new value applies,
and a log line says so.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from pipeline.config import REMOVED_KEYS, Config, ConfigError, flatten
from pipeline.models import arch_from_config, builtin_for_tokenizer, resolve_builtin
from pipeline.models.hf import tokenizer_hash

log = logging.getLogger(__name__)

MARKER = "COMPLETE.json"
CONTROLLER_STATE = "controller_state.pt"
_STEP = re.compile(r"step_(\d+)")
_LEFTOVER = re.compile(r"step_\d+\.(tmp|old)-[\d-]+")


def checkpoint_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


# ---------------------------------------------------------------------- completeness


def incomplete(path: str | Path) -> str | None:
    """Why `path` is not a complete checkpoint directory, or None if it is one."""
    path = Path(path)
    if not path.is_dir():
        return "no such directory"
    if not _STEP.fullmatch(path.name):
        return f"{path.name!r} is not a step_N directory (a save that did not finish?)"
    try:
        marker = json.loads((path / MARKER).read_text())
        files = marker["files"]
    except FileNotFoundError:
        return f"no {MARKER} (the save did not finish)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MARKER} is unreadable ({type(e).__name__})"
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {size} recorded (truncated)"
    return None


def read_marker(path: str | Path) -> dict:
    """The completion marker of a complete checkpoint (raises ConfigError naming run.resume if not)."""
    why = incomplete(path)
    if why is not None:
        raise ConfigError(f"config: run.resume={str(path)!r} is invalid; allowed: 'latest' or a complete "
                          f"checkpoint directory written by run.checkpoint_every (this one: {why})")
    return json.loads((Path(path) / MARKER).read_text())


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete step_N directories under `root`, oldest first (by marker time, then step); an
    incomplete step_N is skipped with a warning."""
    found = []
    for d in Path(root).glob("step_*"):
        if not _STEP.fullmatch(d.name):
            continue  # a tmp / old leftover: never resumed
        why = incomplete(d)
        if why is not None:
            log.warning("checkpoint %s is skipped: %s", d, why)
            continue
        m = json.loads((d / MARKER).read_text())
        found.append((m["written_at"], m["step"], d))
    return [d for _, _, d in sorted(found)]


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    found = complete_checkpoints(root)
    return found[-1] if found else None


# ---------------------------------------------------------------------- writing


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpoints:
    """The checkpoint directory of one run (module docstring): atomic writes, sweep, retention."""

    def __init__(self, cfg: Config):
        self.cfg = cfg  # the user's config: recorded in every marker, diffed on resume
        self.root = checkpoint_root(cfg.run.out_dir)
        self.keep = cfg.run.keep_checkpoints
        self._saves = 0

    def path(self, step: int) -> Path:
        return self.root / f"step_{step}"

    def sweep(self) -> list[Path]:
        """Remove step_N.tmp-* / step_N.old-* left by a save that was killed (call at start, when
        no save of this out_dir is running)."""
        gone = [d for d in self.root.glob("step_*") if _LEFTOVER.fullmatch(d.name)]
        for d in gone:
            log.warning("removing %s, left by a checkpoint save that did not finish", d)
            shutil.rmtree(d, ignore_errors=True)
        return gone

    def begin(self, step: int) -> Path:
        """A new empty directory for one save of step `step`, shared by every writer of that save
        (unique per save: an abandoned save's writers may still be finishing in theirs)."""
        self._saves += 1
        tmp = self.root / f"step_{step}.tmp-{os.getpid()}-{self._saves}"
        tmp.mkdir(parents=True)
        return tmp

    def abort(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def commit(self, tmp: Path, step: int, version: int) -> Path:
        """Seal `tmp` (every file fsync'd, then the marker listing their sizes), rename it to step_N
        (replacing an older step_N) and apply retention. Returns step_N."""
        files = {}
        for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
            _fsync(f)
            files[f.relative_to(tmp).as_posix()] = f.stat().st_size
        marker = {"format": 1, "step": step, "version": version, "written_at": time.time(),
                  "fingerprint": fingerprint(self.cfg), "config": dataclasses.asdict(self.cfg), "files": files}
        with open(tmp / MARKER, "w") as fh:
            json.dump(marker, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        final, old = self.path(step), None
        if final.exists():  # this step of an earlier run in the same out_dir (or a resumed older one)
            old = final.with_name(f"{final.name}.old-{os.getpid()}")
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync(self.root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self.prune()
        return final

    def prune(self) -> list[Path]:
        """Keep the `keep` newest complete checkpoints (0: all); returns the removed ones."""
        found = complete_checkpoints(self.root)
        gone = found[:-self.keep] if self.keep else []
        for d in gone:
            shutil.rmtree(d, ignore_errors=True)
        return gone


def save_controller_state(ckpt_dir: Path, state: dict) -> None:
    torch.save(state, Path(ckpt_dir) / CONTROLLER_STATE)


def load_controller_state(ckpt_dir: str | Path) -> dict:
    # Held groups are pickled pipeline.types dataclasses, hence weights_only=False (our own files).
    return torch.load(Path(ckpt_dir) / CONTROLLER_STATE, weights_only=False)


# ---------------------------------------------------------------------- RNG


def rng_state() -> dict:
    """This process's torch and python RNG (and CUDA's, once initialised)."""
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------- fingerprint and resume


# config keys a resume keeps as they are (the module docstring): what the learner scores the buffer's
# tokens with. Not task.openenv.url and the like: a run may serve its environment on another port.
SCORING_KEYS = ("generator.temperature", "generator.logprobs_mode", "model.dtype")


def _scoring(config: dict) -> dict[str, Any]:
    """SCORING_KEYS' values in a config as dataclasses.asdict gives it (a marker's recorded config)."""
    flat = flatten(config)
    return {k: flat[k] for k in SCORING_KEYS if k in flat}


def fingerprint(cfg: Config) -> dict[str, Any]:
    """What a resume must match (module docstring), read from files only: no model is built."""
    m = cfg.model
    d = Path(resolve_builtin(m.hf_dir))
    try:
        conf = json.loads((d / "config.json").read_text())
        tokenizer = tokenizer_hash(d)
    except (OSError, ValueError) as e:
        raise ConfigError(f"config: model.hf_dir={m.hf_dir!r} is invalid; allowed: a HF checkpoint directory "
                          f"with a readable config.json ({e})") from None
    # every field its family reads (pipeline/models: Arch.fingerprint), as the family reads it
    arch = arch_from_config(conf, m.hf_dir)
    fp: dict[str, Any] = {f"model.{k}": v for k, v in arch.fingerprint().items()}
    fp.update({"tokenizer": tokenizer, "task.name": cfg.task.name,
               "buffer.batch_groups": cfg.buffer.batch_groups, "buffer.group_size": cfg.buffer.group_size})
    fp.update(_scoring(dataclasses.asdict(cfg)))
    return fp


def _key_name(key: str, cfg: Config) -> str:
    """The config key a user changes to move fingerprint entry `key`."""
    if key in SCORING_KEYS:
        return key
    if key == "tokenizer":
        return "model.hf_dir (tokenizer files)"
    if key.startswith("model."):
        return f"model.hf_dir ({key[len('model.'):]} in config.json)"
    return key


def _shown(v: Any) -> str:
    return f"{v[:12]}..." if isinstance(v, str) and len(v) == 64 else repr(v)  # hashes abbreviated


def check_fingerprint(saved: dict, cfg: Config, path: Path) -> None:
    """Raise ConfigError naming the first key whose value differs from the checkpoint's."""
    now = fingerprint(cfg)
    for key in sorted(set(saved) | set(now)):
        if saved.get(key) != now.get(key):
            raise ConfigError(
                f"config: {_key_name(key, cfg)} does not match the checkpoint run.resume={str(path)!r}: "
                f"{key} is {_shown(now.get(key))} here, {_shown(saved.get(key))} in the checkpoint. A resume "
                f"keeps the model shape, tokenizer, task.name, buffer.batch_groups, buffer.group_size, "
                f"{', '.join(SCORING_KEYS)}; start a new run.out_dir to change them")


def config_changes(saved: dict, cfg: Config) -> list[tuple[str, Any, Any]]:
    """(key, checkpoint's value, this config's value) for every key that differs, run.resume aside,
    and the keys removed since (REMOVED_KEYS): an older checkpoint records them, nothing can set them."""
    old, new = flatten(saved), flatten(dataclasses.asdict(cfg))
    return [(k, old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
            if k != "run.resume" and k not in REMOVED_KEYS and old.get(k) != new.get(k)]


def prepare_resume(cfg: Config) -> Config:
    """`cfg` with run.resume resolved ('latest': the newest complete checkpoint under run.out_dir)
    and checked against the checkpoint's fingerprint; raises ConfigError naming run.resume or the
    mismatched key. Logs every other key that changed since the checkpoint (the new value applies)."""
    if not cfg.run.resume:
        return cfg
    if cfg.run.resume == "latest":
        root = checkpoint_root(cfg.run.out_dir)
        path = latest(root)
        if path is None:
            raise ConfigError(f"config: run.resume='latest' is invalid; allowed: 'latest' once a complete "
                              f"checkpoint exists under {str(root)!r} (run.checkpoint_every writes them), "
                              "or a checkpoint directory")
    else:
        path = Path(cfg.run.resume)
    marker = read_marker(path)
    # a fingerprint written before SCORING_KEYS joined it: the checkpoint's recorded config has them
    # (the defaults for a key older than its config)
    recorded = {**_scoring(dataclasses.asdict(Config())), **_scoring(marker["config"])}
    saved = {**recorded, **marker["fingerprint"]}
    # a tokenizer an older fingerprint named otherwise (pipeline/models builtin_for_tokenizer): its files' hash
    builtin = builtin_for_tokenizer(saved.get("tokenizer", ""))
    if builtin is not None:
        saved["tokenizer"] = tokenizer_hash(resolve_builtin(builtin))
    check_fingerprint(saved, cfg, path)
    if cfg.run.steps <= marker["step"]:
        raise ConfigError(f"config: run.steps={cfg.run.steps} is invalid; allowed: more than the step of the "
                          f"checkpoint run.resume={str(path)!r} ({marker['step']}): nothing would be left to train")
    for key, old, new in config_changes(marker["config"], cfg):
        log.info("resume: %s=%r (the checkpoint's run had %r); the new value applies", key, new, old)
    log.info("resume: %s (step %d, version %d)", path, marker["step"], marker["version"])
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=str(path)))
