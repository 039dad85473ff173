"""Delta push core: the elements of one version that differ from the previous one, packed in
self-describing buckets, applied in place, every span checked against the new version's checksum.

A trainer rank's slot is a flat byte space of *spans* (its shard plan's pieces: one dtype each). Two
consecutive versions v-1 and v live in the sender's two slots, so the delta costs no extra copy of
the weights: compare each span of both slots as integers of its item size (bit equality; a NaN or
-0.0 is compared by its bits like any other value) and pack what changed into the delta buffer:

    bucket k (at byte k * D, D = delta_bucket_bytes(...)): int32 [MAGIC, k, records, used bytes]
        then records, each 8-byte aligned:  int32 [span, count] · int32 indices[count] · values[count]
    (indices are element offsets within the span; a span's changes may continue into later buckets)

Every bucket is full up to the last record that fits (< 24 bytes of slack) except the last, so the
delta's wire length is `(n - 1) * D + used(last)`. Besides the buckets the sender publishes the
per-span checksums of the whole new version (checksum.py); the receiver applies every bucket to its
copy of v-1 and checks every span against them, so a corrupted or truncated bucket, a wrong base or a
lost bucket is an error naming the span and the version, never silently served.

Pure and deterministic (like plan.py): the same (spans, old, new) give the same bytes.

Example:
    spans = spans_of(shard_plan, rank)
    n = pack(spans, old_flat, new_flat, delta_buf, D, limit=len(new_flat) // 2)  # None: send full
    sums = checksums(spans, new_flat)
    apply(spans, delta_buf[:n], n, D, base_flat, version=v, where="receiver 0")  # base_flat is now v
    check(spans, base_flat, sums, version=v, where="receiver 0")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from pipeline.weightsync.checksum import Checksum, of_tensor
from pipeline.weightsync.errors import WeightSyncError
from pipeline.weightsync.plan import ALIGN, to_dtype
from pipeline.weightsync.shard_plan import ShardPlan

MAGIC = 0x444C5441  # "DLTA"
BUCKET_HEADER = 16  # int32 magic, index, records, used bytes
RECORD_HEADER = 8  # int32 span, count
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_U64 = 1 << 64


class DeltaError(WeightSyncError):
    """A delta could not be applied (corrupted or truncated bucket, a base the receiver does not
    hold) or its result does not match the trainer's checksums; the staged copy is invalid."""


@dataclass(frozen=True)
class Span:
    """Bytes [offset, offset + nbytes) of a flat space, elements of `itemsize` bytes; `name` for errors."""

    name: str
    offset: int
    nbytes: int
    itemsize: int


def spans_of(shards: ShardPlan, rank: int) -> tuple[Span, ...]:
    """Trainer rank `rank`'s pieces as spans of its flat space, in order."""
    out, entries = [], {e.name: e for e in shards.full.entries}
    for p in shards.pieces_of(rank):
        e = entries[p.name]
        whole = tuple(p.size) == tuple(e.shape)
        name = p.name if whole else f"{p.name}[start {list(p.start)} size {list(p.size)}]"
        out.append(Span(name, p.offset, p.nbytes, to_dtype(e.dtype).itemsize))
    return tuple(out)


def delta_bucket_bytes(nbytes: int, bucket_bytes: int) -> int:
    """Delta bucket size for a flat space of `nbytes`: small enough that a sparse delta's last,
    partly used bucket wastes little (an RDMA read moves whole buffers), large enough to keep the
    count of registered buffers low: nbytes / 64 within [64 KiB, 1 MiB], at most a bucket."""
    d = min(max(nbytes // 64, 64 << 10), 1 << 20, bucket_bytes)
    return max(ALIGN, d // ALIGN * ALIGN)


def capacity(nbytes: int, d: int) -> int:
    """Bytes of the delta buffer of a slot of `nbytes`: whole buckets holding half the slot. A delta
    larger than half the full bytes is not sent (the full version is): it would save under 2x on the
    wire, cost a scatter and a checksum pass, and would need a buffer as large as the slot."""
    return max(1, -(-(nbytes // 2) // d)) * d


def _pad(n: int) -> int:
    return (n + 7) // 8 * 8


def _ints(flat: torch.Tensor, s: Span) -> torch.Tensor:
    return flat[s.offset:s.offset + s.nbytes].view(_INT[s.itemsize])


def pack(spans: Sequence[Span], old: torch.Tensor, new: torch.Tensor, out: torch.Tensor, d: int,
         limit: int) -> int | None:
    """Pack the elements of `new` that differ from `old` into buckets of `d` bytes in `out`; returns
    the delta's wire length, or None when it would exceed `limit` bytes or `out` (send full)."""
    limit = min(limit, out.numel())
    pos, k, records, start = BUCKET_HEADER, 0, 0, 0

    def close() -> None:
        out[start:start + BUCKET_HEADER].view(torch.int32).copy_(torch.tensor([MAGIC, k, records, pos - start],
                                                                              dtype=torch.int32))

    for si, s in enumerate(spans):
        a, b = _ints(old, s), _ints(new, s)
        idx = (a != b).nonzero().view(-1)
        done, n = 0, idx.numel()
        while done < n:
            room = start + d - pos - RECORD_HEADER - 14  # 14: both pads at worst
            c = min(n - done, max(room // (4 + s.itemsize), 0))
            if c == 0:  # this bucket is full: close it, open the next
                close()
                k, records, start = k + 1, 0, start + d
                pos = start + BUCKET_HEADER
                continue
            end = pos + RECORD_HEADER + _pad(4 * c) + _pad(c * s.itemsize)
            if end > limit:
                return None
            part = idx[done:done + c]
            out[pos:pos + RECORD_HEADER].view(torch.int32).copy_(torch.tensor([si, c], dtype=torch.int32))
            q = pos + RECORD_HEADER
            out[q:q + 4 * c].view(torch.int32).copy_(part)
            q += _pad(4 * c)
            out[q:q + c * s.itemsize].view(_INT[s.itemsize]).copy_(b[part])
            pos, done, records = end, done + c, records + 1
    close()
    return pos


def num_buckets(nbytes: int, d: int) -> int:
    return -(-nbytes // d)


def apply(spans: Sequence[Span], buf: torch.Tensor, nbytes: int, d: int, flat: torch.Tensor, version: int,
          where: str) -> int:
    """Apply a delta of wire length `nbytes` (its buckets at `buf[k * d:]`) to `flat` in place;
    returns the elements written. Raises DeltaError naming `where`, the bucket and the version on a
    bucket that is short, corrupted, or names an element outside its span. The caller checks the
    result with `check` (a wrong value or base shows there)."""
    total = 0
    for k in range(num_buckets(nbytes, d)):
        lo, hi = k * d, min((k + 1) * d, nbytes)
        what = f"version {version}: delta bucket {k} for {where}"
        if hi - lo < BUCKET_HEADER or buf.numel() < hi:
            raise DeltaError(f"{what} is truncated: {max(0, min(buf.numel(), hi) - lo)} bytes, expected "
                             f"{hi - lo} (at least {BUCKET_HEADER})")
        magic, index, records, used = buf[lo:lo + BUCKET_HEADER].view(torch.int32).tolist()
        if magic != MAGIC or index != k:
            raise DeltaError(f"{what} is corrupted: header magic {magic:#x} index {index}, expected "
                             f"{MAGIC:#x} {k}")
        if not BUCKET_HEADER <= used <= hi - lo or (hi == nbytes and used != hi - lo):
            raise DeltaError(f"{what} is truncated or corrupted: it says {used} bytes used, "
                             f"{hi - lo} arrived")
        pos, end = lo + BUCKET_HEADER, lo + used
        for _ in range(records):
            if pos + RECORD_HEADER > end:
                raise DeltaError(f"{what} is truncated: record header past its {used} used bytes")
            si, c = buf[pos:pos + RECORD_HEADER].view(torch.int32).tolist()
            if not 0 <= si < len(spans) or c <= 0:
                raise DeltaError(f"{what} is corrupted: record names span {si} with {c} elements "
                                 f"({len(spans)} spans)")
            s = spans[si]
            q = pos + RECORD_HEADER
            stop = q + _pad(4 * c) + _pad(c * s.itemsize)
            if stop > end:
                raise DeltaError(f"{what} is truncated: {c} elements of {s.name} run past its {used} used bytes")
            idx = buf[q:q + 4 * c].view(torch.int32).long()
            n = s.nbytes // s.itemsize
            if int(idx.min()) < 0 or int(idx.max()) >= n:
                raise DeltaError(f"{what} is corrupted: an index of {s.name} lies outside its {n} elements")
            q += _pad(4 * c)
            _ints(flat, s)[idx] = buf[q:q + c * s.itemsize].view(_INT[s.itemsize])
            pos, total = stop, total + c
        if pos != end:
            raise DeltaError(f"{what} is corrupted: {records} records end at byte {pos - lo}, "
                             f"the bucket says {used}")
    return total


def checksums(spans: Sequence[Span], flat: torch.Tensor) -> list[Checksum]:
    """The checksum of every span of `flat` (checksum.py), in order."""
    return [of_tensor(flat[s.offset:s.offset + s.nbytes]) for s in spans]


def to_words(sums: Sequence[Checksum]) -> torch.Tensor:
    """Checksums as int64 words (s0, s1 per span) for a binary header; `from_words` inverts it."""
    signed = lambda x: x - _U64 if x >= 1 << 63 else x  # noqa: E731
    return torch.tensor([signed(w) for c in sums for w in (c.s0, c.s1)], dtype=torch.int64)


def from_words(spans: Sequence[Span], words: torch.Tensor) -> list[Checksum]:
    w = [x % _U64 for x in words.tolist()]
    return [Checksum(s.nbytes, w[2 * i], w[2 * i + 1]) for i, s in enumerate(spans)]


def check(spans: Sequence[Span], flat: torch.Tensor, expected: Sequence[Checksum], version: int,
          where: str) -> None:
    """Raise DeltaError naming the first span of `flat` whose checksum is not the expected one."""
    for s, want, got in zip(spans, expected, checksums(spans, flat)):
        if got != want:
            raise DeltaError(f"version {version}: {where} holds {s.name} with checksum {got} after applying "
                             f"the delta, the trainer's is {want}")


HEADER_WORDS = 8  # int64 [MAGIC, version, base, wire bytes, spans, 0, 0, 0], then (s0, s1) per span


def header_words(num_spans: int) -> int:
    """int64 words of a delta header for `num_spans` spans."""
    return HEADER_WORDS + 2 * num_spans


def write_header(out: torch.Tensor, version: int, base: int, nbytes: int, sums: Sequence[Checksum]) -> None:
    """Fill `out` (int64[header_words(len(sums))]): the delta of `version` against `base`, `nbytes`
    on the wire, and the checksums of the whole new version."""
    out[:HEADER_WORDS] = torch.tensor([MAGIC, version, base, nbytes, len(sums), 0, 0, 0], dtype=torch.int64)
    out[HEADER_WORDS:] = to_words(sums)


def read_header(words: torch.Tensor, spans: Sequence[Span], version: int, held: int | None,
                where: str) -> tuple[int, list[Checksum]]:
    """(wire bytes, checksums) of the delta header `words` of `version`; DeltaError when it is not
    one, or when its base is not `held`, the version the receiver's copy holds (None: no valid copy)."""
    magic, v, base, nbytes, n = words[:5].tolist()
    if magic != MAGIC or v != version or n != len(spans) or nbytes < 0:
        raise DeltaError(f"version {version}: delta header for {where} is corrupted (magic {magic:#x}, "
                         f"version {v}, {n} spans of {len(spans)}, {nbytes} bytes)")
    if held != base:
        raise DeltaError(f"version {version}: delta for {where} is against version {base}, but its staged "
                         f"copy holds {'no valid version' if held is None else f'version {held}'}")
    return nbytes, from_words(spans, words[HEADER_WORDS:header_words(n)])
