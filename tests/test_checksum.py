"""pipeline/weightsync/checksum.py: the checksum against an independent numpy reference (unsigned
wrap-around is defined there), every single-bit change caught, concatenation composed without
copying, and `compare` naming each kind of mismatch.

    .venv/bin/python -m pytest -q tests/test_checksum.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.weightsync import checksum as cs
from pipeline.weightsync.checksum import Checksum, Mismatch, compare, concat, of_dict, of_tensor


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
