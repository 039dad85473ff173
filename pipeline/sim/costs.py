"""The simulator's cost file: every component's cost, named, read from JSON or YAML and checked.

A cost file has five sections and every key below is required (a missing one is an error naming
it, never a default): the planner must not predict from a number nobody measured or wrote down.

    generator:    a vLLM engine; one decode iteration advances every running request by one token
        iter_base_s           seconds of an iteration with nothing in it (weights read, scheduling)
        iter_per_seq_s        + seconds per running request
        iter_per_ctx_token_s  + seconds per token of context held by the running requests (KV reads)
        prefill_per_token_s   seconds per prompt (or re-prefilled) token when a request starts
        request_overhead_s    seconds per finished request outside the engine (reward, send to the buffer)
        admit_s               seconds from an admit call to its group reaching the generator (one call
                              in flight per generator: groups arrive one by one)
    trainer:      one optimizer step on a batch of N samples padded to T tokens
        step_base_s           seconds per step whatever its size (the call, optimizer, metrics)
        step_per_token_s      + seconds per token once per step, whatever the epochs (the batch's
                              preparation and no-grad passes; 0 where per_token_s holds them)
        epoch_base_s          + seconds per PPO epoch (trainer.epochs)
        per_token_s           + seconds per token per epoch (forward and backward)
                              tokens: N·T (padding: max) or the real tokens (none)
        padding               "max" (the batch is right-padded to its longest sample) | "none" (packed)
    push:         one weight push of `bytes` bytes to every generator
        bytes                 bytes pushed (the model's weights as sent)
        pack_base_s, pack_per_byte_s          the trainer's push call: snapshot and pack (the trainer waits for it)
        transfer_base_s, transfer_per_byte_s  into each generator's staging (generation goes on)
        load_base_s, load_per_byte_s          into the engine (generation stalls under keep)
    controller:
        step_overhead_s       seconds per step outside the train call and the batch wait (buffer
                              calls, metrics, hooks); counted as trainer idle, as a real run does
    contention:   what the trainer and the generators cost each other when both are busy at once
                  (shared cores, memory bandwidth); the figures above are each component alone
        trainer_factor        a train step's time while any generator is busy (decoding, prefilling)
                              over its time alone; >= 1
        generator_factor      a generator's engine time (decode, prefill, request overhead) while the
                              trainer trains, over its time alone; >= 1
                              1 and 1: no sharing (a GPU cluster: trainer and engines on their own
                              devices, or colocated and never busy at once); write it, it is not assumed

`source` (free text: how the numbers were obtained) is required too. Extra keys are an error, so a
misspelt key cannot silently fall back to nothing.

Example:
    costs = load_costs("bench_out/plan/costs.json")
    costs.generator.iter_s(running=8, context=800)     # one decode iteration, seconds
    costs.trainer.step_s(tokens=4096, epochs=3)
    costs.push.load_s()
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import yaml

__all__ = ["Costs", "GeneratorCosts", "TrainerCosts", "PushCosts", "ControllerCosts", "ContentionCosts", "CostFileError",
           "load_costs", "costs_from_dict"]


ENGINE_TERMS = ("iter_base_s", "iter_per_seq_s", "iter_per_ctx_token_s", "prefill_per_token_s", "request_overhead_s")
"""The generator's engine-time terms (decode, prefill, per-request work on the generator's cores)."""


class CostFileError(ValueError):
    """A cost file that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class GeneratorCosts:
    iter_base_s: float
    iter_per_seq_s: float
    iter_per_ctx_token_s: float
    prefill_per_token_s: float
    request_overhead_s: float
    admit_s: float

    def iter_s(self, running: int, context: float) -> float:
        """One decode iteration with `running` requests holding `context` tokens in all."""
        return self.iter_base_s + self.iter_per_seq_s * running + self.iter_per_ctx_token_s * context

    def scaled(self, f: float) -> "GeneratorCosts":
        """Every engine time times f (a slower or faster engine); the admit round trip is the buffer's."""
        return replace(self, **{k: getattr(self, k) * f for k in ENGINE_TERMS})


@dataclass(frozen=True)
class TrainerCosts:
    step_base_s: float
    step_per_token_s: float
    epoch_base_s: float
    per_token_s: float
    padding: str

    def step_s(self, tokens: float, epochs: int) -> float:
        """One step on a batch of `tokens` (padded or real, as `padding` says), `epochs` PPO epochs."""
        return (self.step_base_s + self.step_per_token_s * tokens
                + epochs * (self.epoch_base_s + self.per_token_s * tokens))

    def scaled(self, f: float) -> "TrainerCosts":
        """Every time times f (a slower or faster trainer; 1/R of the tokens per rank of R)."""
        return replace(self, step_base_s=self.step_base_s * f, step_per_token_s=self.step_per_token_s * f,
                       epoch_base_s=self.epoch_base_s * f, per_token_s=self.per_token_s * f)


@dataclass(frozen=True)
class PushCosts:
    bytes: float
    pack_base_s: float
    pack_per_byte_s: float
    transfer_base_s: float
    transfer_per_byte_s: float
    load_base_s: float
    load_per_byte_s: float

    def pack_s(self) -> float:
        return self.pack_base_s + self.pack_per_byte_s * self.bytes

    def transfer_s(self) -> float:
        return self.transfer_base_s + self.transfer_per_byte_s * self.bytes

    def load_s(self) -> float:
        return self.load_base_s + self.load_per_byte_s * self.bytes


@dataclass(frozen=True)
class ControllerCosts:
    step_overhead_s: float


@dataclass(frozen=True)
class ContentionCosts:
    trainer_factor: float
    generator_factor: float

    def trainer_slowdown(self, generators_busy: bool) -> float:
        """How much longer the trainer's work takes now: trainer_factor while a generator is busy."""
        return self.trainer_factor if generators_busy else 1.0

    def generator_slowdown(self, trainer_busy: bool) -> float:
        """How much longer a generator's engine work takes now: generator_factor while the trainer trains."""
        return self.generator_factor if trainer_busy else 1.0


@dataclass(frozen=True)
class Costs:
    generator: GeneratorCosts
    trainer: TrainerCosts
    push: PushCosts
    controller: ControllerCosts
    contention: ContentionCosts
    source: str

    def to_dict(self) -> dict:
        return asdict(self)

    def sharing(self, generators: int, devices: int) -> "Costs":
        """These costs for `generators` engines on `devices` devices (0: each its own): with more
        engines than devices each engine's time scales by generators/devices, as engines sharing a
        device (a GPU, or this machine's one generator core) do. The admit round trip is the buffer's."""
        f = generators / devices if devices and generators > devices else 1.0
        return replace(self, generator=self.generator.scaled(f))


_SECTIONS = {"generator": GeneratorCosts, "trainer": TrainerCosts, "push": PushCosts, "controller": ControllerCosts,
             "contention": ContentionCosts}


def costs_from_dict(d: dict, where: str = "costs") -> Costs:
    """Check and build Costs from a parsed cost file; CostFileError names `where` and the key."""
    if not isinstance(d, dict):
        raise CostFileError(f"{where}: a mapping of sections {sorted(_SECTIONS)} and 'source' expected, got {type(d).__name__}")
    missing = [k for k in (*_SECTIONS, "source") if k not in d]
    if missing:
        hint = (" (contention: trainer_factor and generator_factor, measured by `python -m tools.plan calibrate`; "
                "write 1 and 1 for hardware the trainer and the generators do not share)") if "contention" in missing else ""
        raise CostFileError(f"{where}: missing component(s) {missing}; every one of {[*_SECTIONS, 'source']} "
                            f"is required{hint}")
    extra = sorted(set(d) - {*_SECTIONS, "source"})
    if extra:
        raise CostFileError(f"{where}: unknown section(s) {extra}")
    built = {}
    for name, cls in _SECTIONS.items():
        sec = d[name]
        if not isinstance(sec, dict):
            raise CostFileError(f"{where}: {name} must be a mapping of {[f.name for f in fields(cls)]}")
        keys = [f.name for f in fields(cls)]
        gone = [f"{name}.{k}" for k in keys if k not in sec]
        if gone:
            raise CostFileError(f"{where}: missing cost(s) {gone}")
        bad = sorted(f"{name}.{k}" for k in set(sec) - set(keys))
        if bad:
            raise CostFileError(f"{where}: unknown cost key(s) {bad}; allowed: {keys}")
        vals = {}
        for k in keys:
            v = sec[k]
            if k == "padding":
                if v not in ("max", "none"):
                    raise CostFileError(f"{where}: {name}.padding={v!r}; allowed: 'max', 'none'")
            elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise CostFileError(f"{where}: {name}.{k}={v!r}; a finite number >= 0 expected")
            vals[k] = v
        built[name] = cls(**vals)
    if not isinstance(d["source"], str) or not d["source"].strip():
        raise CostFileError(f"{where}: 'source' must say where the numbers come from")
    c = built["contention"]
    for k in ("trainer_factor", "generator_factor"):
        if getattr(c, k) < 1:
            raise CostFileError(f"{where}: contention.{k}={getattr(c, k)!r}; >= 1 expected (1: no sharing)")
    g = built["generator"]
    if g.iter_base_s + g.iter_per_seq_s <= 0:
        raise CostFileError(f"{where}: generator.iter_base_s + generator.iter_per_seq_s must be > 0 (decoding is free)")
    return Costs(**built, source=d["source"])


def load_costs(path: str | Path) -> Costs:
    """Read a cost file (.json, or .yaml/.yml); CostFileError names the file and what is wrong."""
    p = Path(path)
    if not p.is_file():
        raise CostFileError(f"cost file {p} does not exist")
    text = p.read_text()
    try:
        d = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise CostFileError(f"cost file {p}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {e}") from None
    return costs_from_dict(d, str(p))
