"""Shard plan: which trainer rank sends which box of every HF tensor, where in its own flat bytes, and
how a receiver assembles the full tensors from the pieces of all ranks.

    full = BucketPlan.from_state_dict(hf_meta, bucket_bytes)          # the assembled layout (plan.py)
    plan = ShardPlan.build(full, holdings)       # holdings[r]: rank r's boxes [(hf name, start, size)]
    plan.pack(r, tensors, flat)                  # rank r: each held box's local tensor into its place
    shares = plan.checksums(r, flat)             # rank r: its share of each tensor's checksum (checksum.py)
    plan.assemble([flat_0, ..., flat_N-1], out)  # receiver: every piece into the full layout

A box is a rectangular block of one HF tensor: `start` and `size` per dimension (an FSDP2 shard is
rows `[a, b)` of every column; a RowwiseParallel shard a range of columns; a fused-QKV shard splits
into runs of q/k/v rows). A trainer rank holds some boxes; replicated boxes (a norm under tensor
parallelism) are held by several ranks and sent by one of them, chosen deterministically
(tensor index modulo the number of holders, so replicated bytes spread over the ranks). The plan
refuses holdings that do not cover every element of every tensor exactly once.

Rank r's *pieces* (the boxes it sends) lie back to back in its own flat byte space, in HF tensor
order then box start, each box in row-major order, each piece starting 64-byte aligned unless it
continues the previous one's rows. That space is cut into the same fixed-size buckets as the full
plan. With one rank holding whole tensors, its flat space is exactly the full plan's layout
(`identity`): the transports then skip the assembly copy (shm stays zero-copy).

`reads(need)` is the hook for an engine that wants part of a tensor (vLLM with
tensor_parallel_size > 1): `need` maps an HF name to the box that engine rank holds, and the result
says which bytes of which rank land where in it. A TP-1 engine needs every tensor whole (`need=None`).

Like plan.py the plan is pure and deterministic for given (full plan, holdings); its `hash` goes in
every rank's slot header and every receiver checks it.

Example:
    full = BucketPlan.from_state_dict({"w": (torch.bfloat16, (4, 2))}, 64)
    plan = ShardPlan.build(full, [[("w", (0, 0), (2, 2))], [("w", (2, 0), (2, 2))]])
    plan.pieces_of(1)[0].offset            # 0: rank 1's rows 2..3 start its own flat space
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from pipeline.weightsync.checksum import Checksum, add, of_box
from pipeline.weightsync.errors import PlanMismatchError, ShortBufferError
from pipeline.weightsync.plan import ALIGN, BucketPlan, to_dtype

Box = tuple[str, tuple[int, ...], tuple[int, ...]]
"""(HF tensor name, start per dim, size per dim)."""


@dataclass(frozen=True)
class Piece:
    """Box `start`/`size` of HF tensor `name`, sent by trainer `rank` at byte `offset` of its flat space."""

    name: str
    start: tuple[int, ...]
    size: tuple[int, ...]
    rank: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Read:
    """Bytes of one piece that one receiver needs: sub-box `src` of the piece (relative to its start)
    lands at sub-box `dst` of the receiver's box of that tensor (relative to the box's start)."""

    piece: Piece
    src: tuple[tuple[int, ...], tuple[int, ...]]
    dst: tuple[tuple[int, ...], tuple[int, ...]]


def _numel(size: Sequence[int]) -> int:
    n = 1
    for s in size:
        n *= int(s)
    return n


def _slices(start: Sequence[int], size: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(a, a + n) for a, n in zip(start, size))


def _intersect(a0, an, b0, bn):
    """The intersection of boxes a and b, or None."""
    lo = tuple(max(x, y) for x, y in zip(a0, b0))
    hi = tuple(min(x + m, y + n) for x, m, y, n in zip(a0, an, b0, bn))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


@dataclass(frozen=True)
class ShardPlan:
    full: BucketPlan
    world: int
    pieces: tuple[Piece, ...]  # by rank, then offset
    totals: tuple[int, ...]  # bytes of each rank's flat space
    slots: tuple[tuple[int, ...], ...]  # slots[r][i]: flat offset of rank r's holding i, -1: another rank sends it
    identity: bool
    hash: str

    @classmethod
    def whole(cls, full: BucketPlan) -> "ShardPlan":
        """One rank holding every tensor whole: the layout of `full` itself (today's single sender)."""
        return cls.build(full, [[(e.name, (0,) * len(e.shape), e.shape) for e in full.entries]])

    @classmethod
    def build(cls, full: BucketPlan, holdings: Sequence[Sequence[Box]]) -> "ShardPlan":
        """The plan for `holdings[r]` = the boxes trainer rank r holds (in the order it will pass their
        tensors to `pack`). Raises PlanMismatchError naming the tensor a box does not fit, or one not
        covered exactly once."""
        if not holdings:
            raise ValueError("ShardPlan: no trainer ranks")
        index = {e.name: i for i, e in enumerate(full.entries)}
        holders: dict[Box, list[int]] = {}
        norm: list[list[Box]] = []
        for r, boxes in enumerate(holdings):
            norm.append([])
            for name, start, size in boxes:
                e = full.entries[index[name]] if name in index else None
                if e is None:
                    raise PlanMismatchError(f"rank {r} holds {name!r}, which the bucket plan {full.hash} lacks")
                start, size = tuple(int(s) for s in start), tuple(int(s) for s in size)
                if len(start) != len(e.shape) or len(size) != len(e.shape) or any(
                        a < 0 or n < 0 or a + n > d for a, n, d in zip(start, size, e.shape)):
                    raise PlanMismatchError(f"rank {r}: box start={start} size={size} does not fit tensor "
                                            f"{name!r} of shape {e.shape}")
                norm[r].append((name, start, size))
                hs = holders.setdefault((name, start, size), []) if _numel(size) else []
                if _numel(size) and r not in hs:
                    hs.append(r)
        owner = {box: hs[index[box[0]] % len(hs)] for box, hs in holders.items()}
        cls._check_cover(full, sorted(owner, key=lambda b: (index[b[0]], b[1])))
        pieces, totals, slots = [], [], []
        for r in range(len(holdings)):
            mine = sorted((b for b, o in owner.items() if o == r), key=lambda b: (index[b[0]], b[1]))
            pos, prev, at = 0, None, {}
            for name, start, size in mine:
                e = full.entries[index[name]]
                nbytes = _numel(size) * to_dtype(e.dtype).itemsize
                if not cls._continues(prev, name, start, size, e.shape):
                    pos = (pos + ALIGN - 1) // ALIGN * ALIGN
                at[(name, start, size)] = pos
                pieces.append(Piece(name, start, size, r, pos, nbytes))
                pos, prev = pos + nbytes, (name, start, size)
            totals.append(pos)
            slots.append(tuple(at.get(b, -1) for b in norm[r]))
        return cls._make(full, len(holdings), tuple(pieces), tuple(totals), tuple(slots))

    @staticmethod
    def _continues(prev, name, start, size, shape) -> bool:
        """Whether box (start, size) continues box `prev`'s rows in memory (whole rows, next row)."""
        if prev is None or prev[0] != name or not shape:
            return False
        full_rows = lambda a, z: all(x == 0 for x in a[1:]) and tuple(z[1:]) == tuple(shape[1:])  # noqa: E731
        return full_rows(start, size) and full_rows(prev[1], prev[2]) and start[0] == prev[1][0] + prev[2][0]

    @staticmethod
    def _check_cover(full: BucketPlan, boxes: list[Box]) -> None:
        by_name: dict[str, list[Box]] = {}
        for b in boxes:
            by_name.setdefault(b[0], []).append(b)
        for e in full.entries:
            mine = by_name.get(e.name, [])
            have, want = sum(_numel(z) for _, _, z in mine), _numel(e.shape)
            for i, (_, a0, an) in enumerate(mine):
                for _, b0, bn in mine[i + 1:]:
                    if _intersect(a0, an, b0, bn) is not None:
                        raise PlanMismatchError(f"tensor {e.name!r}: boxes start={a0} size={an} and start={b0} "
                                                f"size={bn} overlap (held differently by two ranks)")
            if have != want:
                raise PlanMismatchError(f"tensor {e.name!r} of shape {e.shape}: the trainer ranks' shards cover "
                                        f"{have} of its {want} elements")

    @classmethod
    def _make(cls, full, world, pieces, totals, slots) -> "ShardPlan":
        identity = world == 1 and totals[0] == full.total_bytes and all(
            p.start[1:] == (0,) * (len(p.start) - 1) for p in pieces) and all(
            p.offset == cls._full_offset(full, p) for p in pieces)
        blob = json.dumps([full.hash, world, list(totals), [list(s) for s in slots],
                           [[p.name, list(p.start), list(p.size), p.rank, p.offset, p.nbytes] for p in pieces]])
        return cls(full, world, pieces, totals, slots, identity, hashlib.sha256(blob.encode()).hexdigest()[:16])

    @staticmethod
    def _full_offset(full: BucketPlan, p: Piece) -> int:
        e = next(x for x in full.entries if x.name == p.name)
        row = e.nbytes // e.shape[0] if e.shape and e.shape[0] else 0
        return e.bucket * full.bucket_bytes + e.offset + (p.start[0] * row if p.start else 0)

    # -- geometry of one rank's flat space --

    @property
    def bucket_bytes(self) -> int:
        return self.full.bucket_bytes

    @property
    def hash_int(self) -> int:
        return int(self.hash[:15], 16)

    @property
    def header_hash_int(self) -> int:
        """What every rank's slot header carries: the full plan's hash when the one rank's bytes are
        that layout (the engine may map them as they are), else this plan's."""
        return self.full.hash_int if self.identity else self.hash_int

    def pieces_of(self, rank: int) -> list[Piece]:
        return [p for p in self.pieces if p.rank == rank]

    def num_buckets(self, rank: int) -> int:
        return (self.totals[rank] + self.bucket_bytes - 1) // self.bucket_bytes

    def buckets(self, rank: int, flat: torch.Tensor) -> list[torch.Tensor]:
        """The bucket views of rank `rank`'s flat uint8 space."""
        if flat.numel() < self.totals[rank]:
            raise ShortBufferError(f"rank {rank}: buffer holds {flat.numel()} bytes, shard plan {self.hash} "
                                   f"needs {self.totals[rank]}")
        b, n = self.bucket_bytes, self.totals[rank]
        return [flat[i * b:min((i + 1) * b, n)] for i in range(self.num_buckets(rank))]

    # -- the data path --

    def _view(self, flat: torch.Tensor, p: Piece) -> torch.Tensor:
        return flat[p.offset:p.offset + p.nbytes].view(to_dtype(self._entry(p.name).dtype)).view(p.size)

    def _entry(self, name: str):
        return self.full.entries[self._index()[name]]

    def _index(self) -> dict[str, int]:
        idx = self.__dict__.get("_idx")
        if idx is None:
            idx = {e.name: i for i, e in enumerate(self.full.entries)}
            object.__setattr__(self, "_idx", idx)
        return idx

    def views(self, rank: int, flat: torch.Tensor) -> list[tuple[Piece, torch.Tensor]]:
        """Each piece rank `rank` sends, as a view of its flat space `flat` (plan dtype, box shape)."""
        return [(p, self._view(flat, p)) for p in self.pieces_of(rank)]

    def checksums(self, rank: int, flat: torch.Tensor) -> dict[str, Checksum]:
        """Rank `rank`'s share of the checksum of each HF tensor it sends, read from its packed flat
        space (pipeline/weightsync/checksum.py `of_box`, several boxes of one tensor `add`ed);
        `checksum.combine` over every rank's shares gives the whole tensors' checksums."""
        out: dict[str, Checksum] = {}
        for p, view in self.views(rank, flat):
            c = of_box(view, p.start, self._entry(p.name).shape)
            out[p.name] = add([out[p.name], c]) if p.name in out else c
        return out

    def pack(self, rank: int, tensors: Sequence[torch.Tensor], flat: torch.Tensor,
             version: int | None = None) -> int:
        """Copy rank `rank`'s holdings (`tensors[i]` holds box i, any dtype: the copy casts to the
        plan's) into `flat`; holdings another rank sends are skipped. Returns the bytes written."""
        slots = self.slots[rank]
        if len(tensors) != len(slots):
            raise PlanMismatchError(f"version {version}: rank {rank} passed {len(tensors)} tensors, its shard "
                                    f"plan {self.hash} holds {len(slots)} boxes")
        by_offset = {p.offset: p for p in self.pieces_of(rank)}
        written, pending, pinned = 0, False, None
        for t, off in zip(tensors, slots):
            if off < 0:
                continue
            p = by_offset[off]
            if tuple(t.shape) != p.size:
                raise PlanMismatchError(f"version {version}: rank {rank}'s box of {p.name!r} at {p.start} is "
                                        f"{tuple(t.shape)}, shard plan {self.hash} says {p.size}")
            dst, src = self._view(flat, p), t.detach()
            if src.is_cuda and not dst.is_cuda:
                # cast where the data is (a CPU-side cast of device bytes runs at a few GB/s), then one
                # DMA into page-locked slots (pinning.py), waited for once below
                if pinned is None:  # one query for the whole slot, not one per tensor
                    pinned = flat.is_pinned()
                dst.copy_(src.to(dst.dtype), non_blocking=pinned)
                pending |= pinned
            else:
                dst.copy_(src)
            written += p.nbytes
        if pending:
            torch.cuda.synchronize()
        return written

    def reads(self, need: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]] | None = None) -> list[Read]:
        """What a receiver needing box `need[name]` of each tensor (None: every tensor whole) reads
        from which piece, in piece order."""
        out = []
        for p in self.pieces:
            e = self._entry(p.name)
            if need is None:
                n0, nn = (0,) * len(e.shape), e.shape
            elif p.name in need:
                n0, nn = need[p.name]
            else:
                continue
            hit = _intersect(p.start, p.size, n0, nn)  # a 0-d tensor's () boxes always meet
            if hit is None:
                continue
            lo, sz = hit
            out.append(Read(p, (tuple(a - b for a, b in zip(lo, p.start)), sz),
                            (tuple(a - b for a, b in zip(lo, n0)), sz)))
        return out

    def assemble(self, flats: Sequence[torch.Tensor], out: torch.Tensor, version: int | None = None) -> None:
        """Write every piece of every rank (`flats[r]`: rank r's flat space) into `out`, a flat space in
        the full plan's layout: the whole tensors a TP-1 engine loads."""
        if len(flats) != self.world:
            raise PlanMismatchError(f"version {version}: {len(flats)} rank buffers, shard plan {self.hash} "
                                    f"has {self.world} ranks")
        views = dict(self.full.unpack(out, version))
        for rd in self.reads(None):
            src = self._view(flats[rd.piece.rank], rd.piece)[_slices(*rd.src)]
            views[rd.piece.name][_slices(*rd.dst)].copy_(src)

    # -- wire form --

    def to_wire(self) -> dict:
        return {"full": self.full.to_wire(), "world": self.world, "totals": list(self.totals),
                "slots": [list(s) for s in self.slots], "hash": self.hash,
                "pieces": [[p.name, list(p.start), list(p.size), p.rank, p.offset, p.nbytes] for p in self.pieces]}

    @classmethod
    def from_wire(cls, w: dict) -> "ShardPlan":
        pieces = tuple(Piece(n, tuple(a), tuple(z), r, o, b) for n, a, z, r, o, b in w["pieces"])
        plan = cls._make(BucketPlan.from_wire(w["full"]), int(w["world"]), pieces, tuple(w["totals"]),
                         tuple(tuple(s) for s in w["slots"]))
        if plan.hash != w["hash"]:
            raise PlanMismatchError(f"shard plan hash {w['hash']} does not match its pieces ({plan.hash})")
        return plan
