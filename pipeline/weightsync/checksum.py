"""Exact, composable checksums of tensors' raw bytes, and the comparison of what a generator serves
against what the trainer pushed (weight_sync.verify).

A checksum is a function of a tensor's bytes alone (dtype and shape aside: the caller compares
like with like). The bytes, zero-padded to a multiple of 8, are read as little-endian 64-bit words
x_0 .. x_{m-1}, and

    s0 = Σ x_i            mod 2^64
    s1 = Σ (2i + 1)·x_i   mod 2^64          Checksum(nbytes, s0, s1)

Why these and not a cryptographic hash: they compose. The checksum of the concatenation a‖b of
two byte strings (a's length a multiple of 8) is (s0_a + s0_b, s1_a + s1_b + 2·(|a|/8)·s0_b), so a
fused vLLM parameter (qkv_proj = q‖k‖v along dim 0) is checked against the HF tensors' checksums
without concatenating them, and a row-sharded tensor's checksum can be summed from its shards'.
Any single-bit change is caught: it moves one word by ±2^b (b < 64), hence s1 by (2i + 1)·2^b,
which is odd times a power of two below 2^64, never 0 mod 2^64 (`tests/test_checksum.py` flips
every bit position). A swap of two words i, j moves s1 by 2(i − j)(x_j − x_i), also caught unless
that product is 0 mod 2^64. It is not a defence against a chosen collision; it is a check that the
bytes a generator computes with are the trainer's. Cost: one pass of int64 multiply-and-sum over
the bytes (about a blake2b's speed), on the tensor's own device.

Example:
    ref = of_dict(trainer_sd)                         # name -> Checksum
    got = of_dict(served_sd)
    bad = compare(ref, got, {"qkv.weight": ["q.weight", "k.weight", "v.weight"]})
    assert not bad, bad[0]                            # Mismatch(name, detail)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch

_MOD = 1 << 64
_CHUNK = 1 << 20  # words per pass: bounds the temporary products at 8 MiB


@dataclass(frozen=True)
class Checksum:
    """The checksum of `nbytes` bytes (module docstring). `to_wire` / `from_wire`: a str that any
    RPC carries (vLLM's collective_rpc, Monarch)."""

    nbytes: int
    s0: int
    s1: int

    def to_wire(self) -> str:
        return f"{self.nbytes}:{self.s0:016x}:{self.s1:016x}"

    @classmethod
    def from_wire(cls, s: str) -> "Checksum":
        n, a, b = s.split(":")
        return cls(int(n), int(a, 16), int(b, 16))

    def __str__(self) -> str:
        return self.to_wire()


def of_tensor(t: torch.Tensor) -> Checksum:
    """The checksum of `t`'s bytes in row-major order (a non-contiguous tensor is copied first)."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    n = flat.numel()
    full = n - n % 8
    s0 = s1 = 0
    for base in range(0, full // 8, _CHUNK):
        lo, hi = base * 8, min(full, (base + _CHUNK) * 8)
        s0, s1 = _add(s0, s1, base, *_words_sums(flat[lo:hi]))
    if full < n:  # the tail word, zero-padded
        tail = torch.zeros(8, dtype=torch.uint8, device=flat.device)
        tail[: n - full] = flat[full:]
        s0, s1 = _add(s0, s1, full // 8, *_words_sums(tail))
    return Checksum(n, s0, s1)


def of_dict(named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> dict[str, Checksum]:
    """name -> of_tensor(tensor), for a dict or (name, tensor) pairs (plan.unpack's views)."""
    items = named.items() if isinstance(named, Mapping) else named
    return {name: of_tensor(t) for name, t in items}


def concat(parts: Sequence[Checksum]) -> Checksum:
    """The checksum of the parts' bytes one after the other. Every part but the last must have a
    length that is a multiple of 8 (ValueError otherwise: checksum the concatenation instead)."""
    if not parts:
        return Checksum(0, 0, 0)
    n = s0 = s1 = 0
    for i, p in enumerate(parts):
        if n % 8:
            raise ValueError(f"checksum.concat: part {i - 1} is {parts[i - 1].nbytes} bytes, not a multiple of 8")
        s0, s1 = _add(s0, s1, n // 8, p.s0, p.s1)
        n += p.nbytes
    return Checksum(n, s0, s1)


@dataclass(frozen=True)
class Mismatch:
    """One served tensor that is not the trainer's (or has no counterpart): its name and why."""

    name: str
    detail: str

    def __str__(self) -> str:
        return f"{self.name}: {self.detail}"


def compare(reference: Mapping[str, Checksum], served: Mapping[str, Checksum],
            parts: Mapping[str, Sequence[str]] | None = None) -> list[Mismatch]:
    """Every served tensor against the reference, sorted by name. `parts[name]` lists the
    reference tensors a served tensor is the concatenation of, in order (a fused parameter, or
    another name for a tied one); else it is the reference tensor of its own name. Also a
    mismatch: a served tensor without a reference, and a reference tensor no served tensor
    covers (pushed but not served). Empty list: every byte agrees."""
    parts = parts or {}
    out, covered = [], set()
    for name in sorted(served):
        srcs = list(parts.get(name, [name]))
        covered.update(srcs)
        missing = [s for s in srcs if s not in reference]
        if missing:
            out.append(Mismatch(name, f"served, but the trainer pushed no {', '.join(missing)}"))
            continue
        want = _joined([reference[s] for s in srcs])
        if want != served[name]:
            what = name if srcs == [name] else f"{name} (= {' + '.join(srcs)})"
            out.append(Mismatch(what, f"served checksum {served[name]} != trainer's {want}"))
    out += [Mismatch(name, "pushed by the trainer but not served by the engine")
            for name in sorted(set(reference) - covered)]
    return out


def _joined(parts: list[Checksum]) -> Checksum:
    return parts[0] if len(parts) == 1 else concat(parts)


def _words_sums(b: torch.Tensor) -> tuple[int, int]:
    """(Σ x_j, Σ (2j + 1)·x_j) mod 2^64 over the 64-bit words of `b` (a multiple of 8 bytes), j
    counted from this chunk's start. int64 arithmetic wraps mod 2^64, which is what the sums are."""
    try:
        x = b.view(torch.int64)
    except RuntimeError:  # a view whose byte offset is not 8-aligned: an aligned copy
        x = b.clone().view(torch.int64)
    w = torch.arange(1, 2 * x.numel(), 2, dtype=torch.int64, device=x.device)
    return int(x.sum()) % _MOD, int((x * w).sum()) % _MOD


def _add(s0: int, s1: int, offset_words: int, p0: int, p1: int) -> tuple[int, int]:
    """Append a piece whose sums (p0, p1) were taken from word 0 at `offset_words`."""
    return (s0 + p0) % _MOD, (s1 + p1 + 2 * offset_words * p0) % _MOD
