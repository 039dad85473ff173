"""The delta push core (pipeline/weightsync/delta.py): pack what changed, apply it in place, and every
way a delta can be wrong is an error naming the version and the span. Pure, in-process.

    .venv/bin/python -m pytest -q tests/test_delta.py
"""

from __future__ import annotations

import pytest
import torch

from pipeline.weightsync import delta
from pipeline.weightsync.delta import DeltaError
from pipeline.weightsync.plan import BucketPlan
from pipeline.weightsync.shard_plan import ShardPlan

META = {"embed.weight": (torch.bfloat16, (300, 64)), "norm.weight": (torch.bfloat16, (64,)),
        "scale": (torch.float32, ()), "steps": (torch.int64, (5,)), "big.weight": (torch.bfloat16, (70_001,))}


def setup(world: int = 1):
    full = BucketPlan.from_state_dict(META, 1 << 16)
    if world == 1:
        return ShardPlan.whole(full)
    rows = [(r * 300 // world, (r + 1) * 300 // world) for r in range(world)]
    holdings = [[("embed.weight", (a, 0), (b - a, 64)), ("norm.weight", (0,), (64,)), ("scale", (), ()),
                 ("steps", (0,), (5,)), ("big.weight", (0,), (70_001,))] for a, b in rows]
    return ShardPlan.build(full, holdings)


def flat_of(plan: ShardPlan, rank: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (plan.totals[rank],), dtype=torch.uint8, generator=g)


def change(flat: torch.Tensor, spans, frac: float, seed: int) -> torch.Tensor:
    """A copy of `flat` with about `frac` of every span's elements given new random bits."""
    g = torch.Generator().manual_seed(seed)
    out = flat.clone()
    for s in spans:
        x = out[s.offset:s.offset + s.nbytes].view(delta._INT[s.itemsize])
        hit = torch.rand(x.numel(), generator=g) < frac
        x[hit] ^= torch.randint(1, 127, (int(hit.sum()),), generator=g).to(x.dtype)  # never a no-op
    return out


def roundtrip(spans, old, new, d, limit=None):
    buf = torch.zeros(4 * new.numel() + 4 * d, dtype=torch.uint8)  # room for any delta
    n = delta.pack(spans, old, new, buf, d, limit or buf.numel())
    return buf, n


@pytest.mark.parametrize("world,rank", [(1, 0), (2, 1)])
@pytest.mark.parametrize("frac", [0.01, 0.5])
def test_apply_of_packed_delta_restores_the_new_version_bit_for_bit(world, rank, frac):
    plan = setup(world)
    spans = delta.spans_of(plan, rank)
    old = flat_of(plan, rank, 1)
    new = change(old, spans, frac, 2)
    d = 256  # small buckets: spans continue across many of them
    buf, n = roundtrip(spans, old, new, d)
    changed = sum(int((delta._ints(old, s) != delta._ints(new, s)).sum()) for s in spans)
    assert n is not None and delta.num_buckets(n, d) > 1
    base = old.clone()
    assert delta.apply(spans, buf, n, d, base, version=2, where="receiver 0") == changed
    assert torch.equal(base, new)
    delta.check(spans, base, delta.checksums(spans, new), 2, "receiver 0")
    if frac == 0.01:  # ~6 bytes per changed bf16 element
        assert n < 0.05 * sum(s.nbytes for s in spans)


def test_pack_is_deterministic_and_an_unchanged_version_is_one_empty_bucket():
    plan = setup()
    spans = delta.spans_of(plan, 0)
    old = flat_of(plan, 0, 1)
    new = change(old, spans, 0.02, 3)
    a, na = roundtrip(spans, old, new, 4096)
    b, nb = roundtrip(spans, old, new, 4096)
    assert na == nb and torch.equal(a[:na], b[:nb])
    _, n0 = roundtrip(spans, old, old, 4096)
    assert n0 == delta.BUCKET_HEADER


def test_a_delta_over_the_limit_falls_back_to_full():
    plan = setup()
    spans = delta.spans_of(plan, 0)
    old = flat_of(plan, 0, 1)
    new = change(old, spans, 0.5, 4)  # bf16: 6 bytes per changed element > half of 2 bytes each
    d = delta.delta_bucket_bytes(old.numel(), 1 << 16)
    buf = torch.zeros(delta.capacity(old.numel(), d), dtype=torch.uint8)
    assert delta.pack(spans, old, new, buf, d, old.numel() // 2) is None
    assert delta.pack(spans, old, change(old, spans, 0.01, 4), buf, d, old.numel() // 2) is not None


def _packed(frac=0.05):
    plan = setup()
    spans = delta.spans_of(plan, 0)
    old = flat_of(plan, 0, 1)
    new = change(old, spans, frac, 5)
    buf, n = roundtrip(spans, old, new, 4096)
    return spans, old, new, buf, n


def test_a_corrupted_bucket_is_an_error_naming_bucket_and_version():
    spans, old, new, buf, n = _packed()
    bad = buf.clone()
    bad[4096 + 8] ^= 0x40  # bucket 1's record count
    with pytest.raises(DeltaError, match=r"version 7: delta bucket 1 for generator3 is (truncated|corrupted)"):
        delta.apply(spans, bad, n, 4096, old.clone(), 7, "generator3")
    bad = buf.clone()
    bad[4096 + delta.BUCKET_HEADER + 8:4096 + delta.BUCKET_HEADER + 12].view(torch.int32)[0] = 1 << 30  # an index
    with pytest.raises(DeltaError, match=r"delta bucket 1 .* corrupted: an index of .* lies outside"):
        delta.apply(spans, bad, n, 4096, old.clone(), 7, "generator3")


def test_a_corrupted_value_fails_the_checksum_naming_the_tensor():
    spans, old, new, buf, n = _packed()
    bad = buf.clone()
    bad[n - 1] ^= 1  # last byte: a value of the last record (records end 8-aligned: a pad byte is possible)
    bad[n - 9] ^= 1
    base = old.clone()
    delta.apply(spans, bad, n, 4096, base, 7, "generator3")
    with pytest.raises(DeltaError, match=r"version 7: generator3 holds big.weight with checksum .* the trainer's"):
        delta.check(spans, base, delta.checksums(spans, new), 7, "generator3")


def test_a_truncated_delta_is_an_error():
    spans, old, new, buf, n = _packed()
    with pytest.raises(DeltaError, match=r"version 7: delta bucket \d+ for r0 is truncated"):
        delta.apply(spans, buf[:n - 100], n, 4096, old.clone(), 7, "r0")
    with pytest.raises(DeltaError, match=r"version 7: delta bucket \d+ for r0 is truncated or corrupted"):
        delta.apply(spans, buf, n - 8, 4096, old.clone(), 7, "r0")  # the header says fewer bytes than the bucket's


def test_a_delta_applied_to_the_wrong_base_fails_the_checksum_and_the_header_names_the_base():
    plan = setup()
    spans = delta.spans_of(plan, 0)
    v1 = flat_of(plan, 0, 1)
    v2 = change(v1, spans, 0.05, 6)
    v3 = change(v2, spans, 0.05, 7)
    buf, n = roundtrip(spans, v2, v3, 4096)
    head = torch.zeros(delta.header_words(len(spans)), dtype=torch.int64)
    sums = delta.checksums(spans, v3)
    delta.write_header(head, 3, 2, n, sums)
    assert delta.read_header(head, spans, 3, 2, "generator1") == (n, sums)
    with pytest.raises(DeltaError, match=r"version 3: delta for generator1 is against version 2, but its staged "
                                         r"copy holds version 1"):
        delta.read_header(head, spans, 3, 1, "generator1")
    with pytest.raises(DeltaError, match="holds no valid version"):
        delta.read_header(head, spans, 3, None, "generator1")
    base = v1.clone()  # applied anyway onto v1: the checksums catch it
    delta.apply(spans, buf, n, 4096, base, 3, "generator1")
    with pytest.raises(DeltaError, match="version 3: generator1 holds .* after applying the delta"):
        delta.check(spans, base, sums, 3, "generator1")


def test_checksum_words_round_trip_unsigned_sums():
    plan = setup()
    spans = delta.spans_of(plan, 0)
    sums = delta.checksums(spans, flat_of(plan, 0, 9))
    assert any(c.s0 >= 1 << 63 or c.s1 >= 1 << 63 for c in sums)
    assert delta.from_words(spans, delta.to_words(sums)) == sums
