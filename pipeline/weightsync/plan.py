"""Bucket plan: where every tensor of an HF-named state dict lives in a flat byte space cut into buckets.

    plan = BucketPlan.from_state_dict(hf_sd, bucket_bytes=64 << 20)   # or {name: (dtype, shape)}
    plan.pack(hf_sd, flat)              # one copy per tensor into a uint8 [plan.total_bytes] tensor
    for name, view in plan.unpack(flat): ...   # zero-copy views, right dtype and shape

Tensors are laid out back to back in state-dict order (which follows the model's layers, so vLLM's
layerwise reload can finish a layer as soon as its last tensor arrives), each start aligned to 64
bytes. Buckets are fixed-size windows `[i*B, (i+1)*B)` of that space (the last one shorter), so a
tensor larger than a bucket simply continues into the next ones. Transports move buckets; because
every side keeps the buckets of one version adjacent in one flat tensor, a tensor spanning buckets
is still a single contiguous view and unpacking never copies.

The plan is deterministic for a given (names, dtypes, shapes, order, bucket size); its `hash` travels
with every push and every side checks it before trusting the bytes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

from pipeline.weightsync.errors import PlanMismatchError, ShortBufferError

ALIGN = 64  # bytes; keeps every dtype view legal and starts on a cache line


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise PlanMismatchError(f"unknown dtype {name!r} in bucket plan")
    return dt


@dataclass(frozen=True)
class PlanEntry:
    """One tensor: starts at byte `offset` of bucket `bucket` and runs `nbytes` (maybe into later buckets)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BucketPlan:
    bucket_bytes: int
    entries: tuple[PlanEntry, ...]
    total_bytes: int
    hash: str

    @classmethod
    def from_state_dict(cls, sd_or_meta: Mapping[str, object], bucket_bytes: int) -> "BucketPlan":
        """Plan for a state dict of tensors (any device, meta, DTensor) or `{name: (dtype, shape)}`."""
        if bucket_bytes < ALIGN or bucket_bytes % ALIGN:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be a positive multiple of {ALIGN}")
        if not sd_or_meta:
            raise ValueError("cannot plan an empty state dict")
        entries, pos = [], 0
        for name, v in sd_or_meta.items():
            dtype, shape = (v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else (v[0], tuple(v[1]))
            numel = 1
            for s in shape:
                numel *= int(s)
            nbytes = numel * dtype.itemsize
            pos = (pos + ALIGN - 1) // ALIGN * ALIGN
            entries.append(PlanEntry(name, dtype_name(dtype), tuple(int(s) for s in shape),
                                     pos // bucket_bytes, pos % bucket_bytes, nbytes))
            pos += nbytes
        return cls._make(bucket_bytes, tuple(entries), pos)

    @classmethod
    def _make(cls, bucket_bytes: int, entries: tuple[PlanEntry, ...], total: int) -> "BucketPlan":
        blob = json.dumps([bucket_bytes, ALIGN, total, [[e.name, e.dtype, list(e.shape), e.bucket, e.offset,
                                                         e.nbytes] for e in entries]])
        return cls(bucket_bytes, entries, total, hashlib.sha256(blob.encode()).hexdigest()[:16])

    # -- wire form (plain lists, so it crosses vLLM's RPC without pickling) --

    def to_wire(self) -> dict:
        return {"bucket_bytes": self.bucket_bytes, "total_bytes": self.total_bytes, "hash": self.hash,
                "entries": [[e.name, e.dtype, list(e.shape), e.bucket, e.offset, e.nbytes] for e in self.entries]}

    @classmethod
    def from_wire(cls, w: dict) -> "BucketPlan":
        entries = tuple(PlanEntry(n, d, tuple(s), b, o, nb) for n, d, s, b, o, nb in w["entries"])
        plan = cls._make(int(w["bucket_bytes"]), entries, int(w["total_bytes"]))
        if plan.hash != w["hash"]:
            raise PlanMismatchError(f"bucket plan hash {w['hash']} does not match its entries ({plan.hash})")
        return plan

    # -- geometry --

    @property
    def num_buckets(self) -> int:
        return (self.total_bytes + self.bucket_bytes - 1) // self.bucket_bytes

    @property
    def hash_int(self) -> int:
        """The hash as a non-negative int64, for binary headers."""
        return int(self.hash[:15], 16)

    def bucket_range(self, i: int) -> tuple[int, int]:
        start = i * self.bucket_bytes
        return start, min(start + self.bucket_bytes, self.total_bytes)

    def buckets(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The bucket views of a flat uint8 tensor holding one version."""
        self._check_flat(flat, version=None)
        return [flat[a:b] for a, b in map(self.bucket_range, range(self.num_buckets))]

    def _check_flat(self, flat: torch.Tensor, version: int | None) -> None:
        if flat.dtype != torch.uint8 or flat.dim() != 1:
            raise TypeError(f"bucket storage must be a 1-d uint8 tensor, got {flat.dtype} {tuple(flat.shape)}")
        if flat.numel() < self.total_bytes:
            last = (flat.numel()) // self.bucket_bytes
            raise ShortBufferError(f"version {version}: buffer holds {flat.numel()} bytes, plan {self.hash} "
                                   f"needs {self.total_bytes}; bucket {last} is short")

    def check_state_dict(self, sd: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Raise PlanMismatchError naming the first tensor that does not match the plan."""
        names = {e.name for e in self.entries}
        if set(sd) != names:
            missing, extra = sorted(names - set(sd))[:5], sorted(set(sd) - names)[:5]
            raise PlanMismatchError(f"version {version}: state dict does not match plan {self.hash}: "
                                    f"missing={missing} unexpected={extra}")
        for e in self.entries:
            t = sd[e.name]
            if dtype_name(t.dtype) != e.dtype or tuple(t.shape) != e.shape:
                raise PlanMismatchError(f"version {version}: tensor {e.name!r} is {dtype_name(t.dtype)} "
                                        f"{tuple(t.shape)}, plan {self.hash} (bucket {e.bucket}) says "
                                        f"{e.dtype} {e.shape}")

    # -- pack / unpack --

    def _view(self, flat: torch.Tensor, e: PlanEntry) -> torch.Tensor:
        start = e.bucket * self.bucket_bytes + e.offset
        return flat[start:start + e.nbytes].view(to_dtype(e.dtype)).view(e.shape)

    def pack(self, sd: Mapping[str, torch.Tensor], flat: torch.Tensor, version: int | None = None) -> None:
        """Copy every tensor into its place in `flat` (one copy each; DTensors are gathered first)."""
        self.check_state_dict(sd, version)
        self._check_flat(flat, version)
        for e in self.entries:
            t = sd[e.name]
            full = getattr(t, "full_tensor", None)
            self._view(flat, e).copy_((full() if callable(full) else t).detach())

    def unpack(self, flat: torch.Tensor, version: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Zero-copy `(name, view)` pairs in plan order."""
        self._check_flat(flat, version)
        for e in self.entries:
            yield e.name, self._view(flat, e)
