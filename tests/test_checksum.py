"""pipeline/weightsync/checksum.py: the checksum against an independent numpy reference (unsigned
wrap-around is defined there), every single-bit change caught, concatenation composed without
copying, shares of a tensor's shards (dim-0, tensor-parallel columns, 2-D blocks, a shard plan's
pieces on 2 and 4 ranks) adding up to the whole tensor's checksum, and `compare` naming each kind of
mismatch.

    .venv/bin/python -m pytest -q tests/test_checksum.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.weightsync import checksum as cs
from pipeline.weightsync.checksum import Checksum, Mismatch, add, combine, compare, concat, of_box, of_dict, of_tensor
from pipeline.weightsync.plan import BucketPlan
from pipeline.weightsync.shard_plan import ShardPlan


def reference(t: torch.Tensor) -> Checksum:
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    n = len(raw)
    x = np.frombuffer(raw + b"\0" * (-n % 8), dtype="<u8")
    w = np.arange(1, 2 * len(x), 2, dtype=np.uint64)
    return Checksum(n, int(x.sum(dtype=np.uint64)), int((x * w).sum(dtype=np.uint64)))


@pytest.mark.parametrize("dtype, n", [(torch.bfloat16, 1), (torch.bfloat16, 4097), (torch.float32, 3),
                                      (torch.float32, 2048), (torch.int8, 13), (torch.float64, 5)])
def test_checksum_equals_the_numpy_reference(dtype, n):
    t = (torch.randn(n, dtype=torch.float64) * 1e3).to(dtype)
    assert of_tensor(t) == reference(t)


def test_checksum_over_several_chunks_equals_one_pass(monkeypatch):
    t = torch.randn(10_001, dtype=torch.float32)
    whole = of_tensor(t)
    monkeypatch.setattr(cs, "_CHUNK", 1000)  # 5 chunks of words and a tail
    assert of_tensor(t) == whole == reference(t)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_single_bit_flip_changes_the_checksum(dtype):
    """Each bit of the first, a middle and the last element, flipped alone, changes both sums'
    checksum (the one of a bit flip elsewhere too: random positions)."""
    t = torch.randn(1001, dtype=torch.float32).to(dtype)
    base = of_tensor(t)
    bits = t.element_size() * 8
    words = t.view(torch.int16 if bits == 16 else torch.int32)
    positions = [0, 500, 1000, *torch.randint(0, 1001, (20,), generator=torch.Generator().manual_seed(0)).tolist()]
    for i in positions:
        for b in range(bits):
            w = words.clone()
            w[i] ^= (1 << b) if b < bits - 1 else -(1 << b)  # the top bit: the sign of the int view
            got = of_tensor(w.view(dtype))
            assert got != base and got.s1 != base.s1, (i, b)


def test_a_swap_and_a_shift_are_caught():
    t = torch.randn(64, dtype=torch.bfloat16)
    swapped = t.clone()
    swapped[[3, 40]] = t[[40, 3]]
    assert of_tensor(swapped) != of_tensor(t)
    assert of_tensor(torch.roll(t, 1)) != of_tensor(t)


def test_concat_composes_the_checksum_of_the_concatenation():
    a, b, c = torch.randn(8, 16).bfloat16(), torch.randn(4, 16).bfloat16(), torch.randn(3, 5).bfloat16()
    assert concat([of_tensor(a), of_tensor(b), of_tensor(c)]) == of_tensor(torch.cat([a.reshape(-1), b.reshape(-1),
                                                                                       c.reshape(-1)]))
    with pytest.raises(ValueError, match="part 0 is 30 bytes"):
        concat([of_tensor(c), of_tensor(a)])


def test_unaligned_view_of_a_buffer_is_checksummed_like_a_copy():
    buf = torch.arange(100, dtype=torch.int16)
    view = buf[3:50]  # starts 6 bytes into its storage: not 8-aligned
    assert of_tensor(view) == of_tensor(view.clone()) == reference(view.clone())


def test_wire_form_round_trips():
    c = of_tensor(torch.randn(33))
    assert Checksum.from_wire(c.to_wire()) == c


def test_compare_names_every_kind_of_mismatch():
    q, k, v, n = (torch.randn(4, 8).bfloat16() for _ in range(4))
    ref = of_dict({"q": q, "k": k, "v": v, "norm": n, "extra": n})
    served = of_dict({"qkv": torch.cat([q, k, v]), "norm": n, "lm_head": n, "ghost": n})
    parts = {"qkv": ["q", "k", "v"], "lm_head": ["norm"]}  # a tied tensor: another name for a pushed one
    assert compare(ref, {k_: served[k_] for k_ in ("qkv", "norm", "lm_head")}, parts) == \
        [Mismatch("extra", "pushed by the trainer but not served by the engine")]
    bad = compare(ref, {**served, "qkv": of_tensor(torch.cat([q, v, k]))}, parts)
    assert [m.name for m in bad] == ["ghost", "qkv (= q + k + v)", "extra"]
    assert "trainer pushed no ghost" in bad[0].detail and "served checksum" in bad[1].detail
    assert compare(ref, of_dict({"qkv": torch.cat([q, k, v]), "norm": n}), {"qkv": ["q", "k", "v"], "norm": ["norm"]}) \
        == [Mismatch("extra", "pushed by the trainer but not served by the engine")]


def shares(w: torch.Tensor, boxes) -> Checksum:
    return add([of_box(w[tuple(slice(a, a + n) for a, n in zip(start, size))], start, w.shape) for start, size in boxes])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
@pytest.mark.parametrize("cuts", [[0, 5, 11], [0, 1, 4, 9, 11], [0, 3, 3, 10, 11]])  # 2 and 4 ranks, uneven, one empty
def test_uneven_dim0_shards_shares_add_up_to_the_whole_tensors_checksum(dtype, cuts):
    """FSDP2's dim-0 shards: each rank's share of rows [a, b), added, is the whole tensor's checksum,
    and equals the concatenation's composition in row order (rows of 13 elements: unaligned)."""
    w = (torch.randn(11, 13, dtype=torch.float64) * 1e3).to(dtype)
    boxes = [((a, 0), (b - a, 13)) for a, b in zip(cuts, cuts[1:])]
    assert shares(w, boxes) == of_tensor(w) == reference(w)
    aligned = w[:, :8].contiguous()  # rows a multiple of 8 bytes: concat applies too
    assert concat([of_tensor(aligned[a:b]) for a, b in zip(cuts, cuts[1:])]) == shares(
        aligned, [((a, 0), (b - a, 8)) for a, b in zip(cuts, cuts[1:])]) == of_tensor(aligned)
    v = (torch.randn(11, dtype=torch.float64) * 1e3).to(dtype)  # a 1-D tensor (a norm) split the same way
    assert shares(v, [((a,), (b - a,)) for a, b in zip(cuts, cuts[1:])]) == of_tensor(v)


@pytest.mark.parametrize("tp, dp", [(2, 1), (2, 2), (4, 1)])
def test_tensor_parallel_column_and_block_shares_add_up_to_the_whole(tp, dp):
    """RowwiseParallel's column shards, and 2-D (dp rows x tp columns) blocks, uneven: shares add up."""
    w = torch.randn(9, 14).bfloat16()
    cols = [0, *sorted(torch.randperm(13, generator=torch.Generator().manual_seed(tp))[:tp - 1].add(1).tolist()), 14]
    rows = [0, 4, 9][:dp] + [9]
    boxes = [((r0, c0), (r1 - r0, c1 - c0)) for r0, r1 in zip(rows, rows[1:]) for c0, c1 in zip(cols, cols[1:])]
    assert len(boxes) == tp * dp and shares(w, boxes) == of_tensor(w)
    moved = w.clone()
    moved.view(torch.int16)[8, 3] ^= 1  # one bit off in one rank's block: the sum of the shares sees it
    assert shares(moved, boxes) != of_tensor(w)


def test_sharded_plan_pieces_checksummed_per_rank_combine_to_every_tensor(monkeypatch):
    """What the trainer does: each rank packs its pieces (ShardPlan), checksums each packed piece's
    share, and `combine` over the ranks' shares gives each whole tensor's checksum, including fused-QKV
    style runs of rows, column splits and a replicated norm sent by one rank; several chunks too."""
    monkeypatch.setattr(cs, "_CHUNK", 3)
    sd = {"q": torch.randn(6, 10).bfloat16(), "o": torch.randn(10, 6).bfloat16(), "norm": torch.randn(10).bfloat16()}
    full = BucketPlan.from_state_dict(sd, 256)
    holdings = [[("q", (0, 0), (1, 10)), ("q", (4, 0), (2, 10)), ("o", (0, 0), (10, 2)), ("norm", (0,), (10,))],
                [("q", (1, 0), (3, 10)), ("o", (0, 2), (10, 4)), ("norm", (0,), (10,))]]
    plan = ShardPlan.build(full, holdings)
    per_rank = []
    for r, boxes in enumerate(holdings):
        flat = torch.zeros(plan.totals[r], dtype=torch.uint8)
        plan.pack(r, [sd[n][tuple(slice(a, a + k) for a, k in zip(s, z))] for n, s, z in boxes], flat)
        per_rank.append({})
        for p, view in plan.views(r, flat):
            c = of_box(view, p.start, sd[p.name].shape)
            per_rank[r][p.name] = add([per_rank[r][p.name], c]) if p.name in per_rank[r] else c
    assert sum("norm" in s for s in per_rank) == 1  # replicated: one rank sends it, one share
    assert combine(per_rank) == of_dict(sd)
    with pytest.raises(ValueError, match="not of one tensor"):
        add([per_rank[0]["q"], next(s["norm"] for s in per_rank if "norm" in s)])


def test_a_box_outside_its_tensor_is_refused():
    with pytest.raises(ValueError, match=r"box start=\(2, 0\) size=\(3, 4\) does not fit shape \(4, 4\)"):
        of_box(torch.zeros(3, 4), (2, 0), (4, 4))
