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
without concatenating them. Both sums are linear in the bytes, so a tensor split into disjoint
boxes (a trainer rank's shard: rows, columns, blocks) has the sum of its boxes' *shares* as its
checksum, a box's share being the checksum of the whole tensor with every element outside the box
zero (`of_box`, summed by `add`): each trainer rank checksums only its own shards.
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
    whole = add([of_box(w[:3], (0, 0), w.shape), of_box(w[3:], (3, 0), w.shape)])   # == of_tensor(w)
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


def of_box(t: torch.Tensor, start: Sequence[int], shape: Sequence[int]) -> Checksum:
    """The checksum of a tensor of `shape` (t's dtype) holding `t` in the box that starts at `start`
    and zeros elsewhere: this box's share of the whole tensor's checksum. Shares of boxes that
    tile a tensor (each element in exactly one) `add` up to its checksum, whatever the boxes' shape
    and alignment: zero bytes add nothing to either sum, and boxes never share a byte.

    Example:
        w = torch.randn(4, 6)
        assert add([of_box(w[:, :2], (0, 0), w.shape), of_box(w[:, 2:], (0, 2), w.shape)]) == of_tensor(w)
    """
    shape, start, size = tuple(int(s) for s in shape), tuple(int(s) for s in start), tuple(t.shape)
    if len(start) != len(shape) or len(size) != len(shape) or any(
            a < 0 or a + n > d for a, n, d in zip(start, size, shape)):
        raise ValueError(f"checksum.of_box: box start={start} size={size} does not fit shape {shape}")
    if size == shape:
        return of_tensor(t)
    item = t.element_size()
    nbytes = item * _numel(shape)
    if t.numel() == 0:
        return Checksum(nbytes, 0, 0)
    first = start[0] * _numel(shape[1:]) * item
    if size[1:] == shape[1:] and first % 8 == 0:  # whole rows (FSDP2's dim-0 shard): one aligned run
        c = of_tensor(t)
        return Checksum(nbytes, *_add(0, 0, first // 8, c.s0, c.s1))
    # the box's rows along the last dim: each a run of bytes at a known offset of the whole tensor
    off, stride = torch.tensor([start[-1]], dtype=torch.int64), 1
    for d in range(len(shape) - 2, -1, -1):
        stride *= shape[d + 1]
        off = ((start[d] + torch.arange(size[d], dtype=torch.int64))[:, None] * stride + off[None, :]).reshape(-1)
    off = off * item
    rows = t.detach().contiguous().reshape(-1, size[-1]).view(torch.uint8)
    length = rows.shape[1]
    s0 = s1 = 0
    for shift in torch.unique(off % 8).tolist():  # rows whose bytes start at the same place in a word
        sel = (off % 8 == shift).nonzero().reshape(-1)
        words = (shift + length + 7) // 8
        step = max(1, _CHUNK // words)
        for lo in range(0, sel.numel(), step):
            idx = sel[lo:lo + step]
            buf = torch.zeros(idx.numel(), words * 8, dtype=torch.uint8, device=rows.device)
            buf[:, shift:shift + length] = rows[idx.to(rows.device)]
            p0, p1 = _rows_sums(buf.view(torch.int64), (off[idx] // 8).to(rows.device))
            s0, s1 = (s0 + p0) % _MOD, (s1 + p1) % _MOD
    return Checksum(nbytes, s0, s1)


def add(shares: Sequence[Checksum]) -> Checksum:
    """The checksum of a tensor from its boxes' shares (`of_box`; the boxes tiling it). ValueError
    if the shares are not of one tensor size (shares of different tensors)."""
    if not shares or len({c.nbytes for c in shares}) != 1:
        raise ValueError(f"checksum.add: shares of tensors of {sorted({c.nbytes for c in shares})} bytes, "
                         "not of one tensor")
    return Checksum(shares[0].nbytes, sum(c.s0 for c in shares) % _MOD, sum(c.s1 for c in shares) % _MOD)


def combine(shares: Iterable[Mapping[str, Checksum]]) -> dict[str, Checksum]:
    """name -> the checksum of the whole tensor, from every trainer rank's name -> its share (a
    rank that holds nothing of a tensor leaves it out)."""
    by_name: dict[str, list[Checksum]] = {}
    for rank_shares in shares:
        for name, c in rank_shares.items():
            by_name.setdefault(name, []).append(c)
    return {name: add(cs) for name, cs in by_name.items()}


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


def _rows_sums(x: torch.Tensor, base: torch.Tensor) -> tuple[int, int]:
    """Both sums of rows of words, row r's word j being word base[r] + j of the whole tensor:
    Σ (2(base_r + j) + 1)·x_rj = Σ_r 2·base_r·(Σ_j x_rj) + Σ (2j + 1)·x_rj, in wrapping int64."""
    w = torch.arange(1, 2 * x.shape[1], 2, dtype=torch.int64, device=x.device)
    row = x.sum(dim=1)
    return int(row.sum()) % _MOD, (int((2 * base * row).sum()) + int((x * w).sum())) % _MOD


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _add(s0: int, s1: int, offset_words: int, p0: int, p1: int) -> tuple[int, int]:
    """Append a piece whose sums (p0, p1) were taken from word 0 at `offset_words`."""
    return (s0 + p0) % _MOD, (s1 + p1 + 2 * offset_words * p0) % _MOD
