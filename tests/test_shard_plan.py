"""The resharding plan of a sharded weight push (pipeline/weightsync/shard_plan.py), pure: every
element sent exactly once, deterministic, uneven FSDP shards, tensor-parallel column shards and
replicas, the fused-QKV split of the real model, and the receiver's slice hook.

    .venv/bin/python -m pytest -q tests/test_shard_plan.py
"""

from __future__ import annotations

import pytest
import torch

from pipeline.config import ModelConfig
from pipeline.models.hf import build_model, export_hf, model_dir
from pipeline.trainer.shards import _qkv_runs
from pipeline.weightsync import BucketPlan, PlanMismatchError, ShardPlan


def model_sd() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"emb": torch.randn(10, 6, generator=g).bfloat16(), "norm": torch.randn(6, generator=g).bfloat16(),
            "w1": torch.randn(7, 6, generator=g).bfloat16(), "w2": torch.randn(6, 8, generator=g).bfloat16(),
            "scale": torch.randn((), generator=g)}


def rows(t: torch.Tensor, n: int) -> list[tuple[int, int]]:
    """torch.chunk's split of dim 0 over n ranks (FSDP2's), empty chunks included: (start, rows)."""
    out, a = [], 0
    for c in torch.chunk(torch.arange(t.shape[0]), n) if t.dim() else []:
        out.append((a, len(c)))
        a += len(c)
    return out + [(a, 0)] * (n - len(out))


def fsdp(sd, n: int):
    """Boxes and tensors of an n-rank FSDP2 sharding (dim 0, uneven, 0-d tensors on every rank)."""
    boxes, tensors = [[] for _ in range(n)], [[] for _ in range(n)]
    for k, t in sd.items():
        for r, (a, m) in enumerate(rows(t, n)):
            if t.dim() == 0:
                boxes[r].append((k, (), ()))
                tensors[r].append(t)
            elif m:
                boxes[r].append((k, (a, *[0] * (t.dim() - 1)), (m, *t.shape[1:])))
                tensors[r].append(t[a:a + m].float())  # the float32 master: packing casts it
    return boxes, tensors


def round_trip(full: BucketPlan, plan: ShardPlan, tensors) -> dict[str, torch.Tensor]:
    flats = [torch.zeros(n, dtype=torch.uint8) for n in plan.totals]
    sent = [plan.pack(r, tensors[r], flats[r]) for r in range(plan.world)]
    assert sum(sent) == sum(p.nbytes for p in plan.pieces)
    out = torch.zeros(full.total_bytes, dtype=torch.uint8)
    plan.assemble(flats, out)
    return {k: v.clone() for k, v in full.unpack(out)}


@pytest.mark.parametrize("n", [1, 2, 3, 4, 16])
def test_fsdp_shards_cover_every_element_once_and_assemble_bit_exact(n):
    sd = model_sd()
    full = BucketPlan.from_state_dict(sd, 128)
    boxes, tensors = fsdp(sd, n)
    plan = ShardPlan.build(full, boxes)
    assert plan.identity == (n == 1)  # one rank: its bytes are the full layout, nothing to assemble
    cover = {k: torch.zeros(t.shape, dtype=torch.int32) for k, t in sd.items()}
    for p in plan.pieces:
        cover[p.name][tuple(slice(a, a + m) for a, m in zip(p.start, p.size))] += 1
    assert all(bool((c == 1).all()) for c in cover.values())
    assert [p.name for p in plan.pieces if p.name == "scale"] == ["scale"]  # a replica is sent once
    got = round_trip(full, plan, tensors)
    assert all(torch.equal(got[k].view(-1).view(torch.uint8), sd[k].view(-1).view(torch.uint8)) for k in sd)
    if n > 1:  # every rank with rows sends about 1/n of the bytes
        assert max(plan.totals) < 0.8 * full.total_bytes


def test_plan_is_deterministic_and_survives_the_wire():
    sd = model_sd()
    full = BucketPlan.from_state_dict(sd, 128)
    a, b = ShardPlan.build(full, fsdp(sd, 3)[0]), ShardPlan.build(full, fsdp(sd, 3)[0])
    assert a == b and a.hash == b.hash and ShardPlan.from_wire(a.to_wire()) == a
    assert ShardPlan.build(full, fsdp(sd, 2)[0]).hash != a.hash
    w = a.to_wire()
    w["pieces"][0][4] += 64  # a tampered offset
    with pytest.raises(PlanMismatchError, match="does not match its pieces"):
        ShardPlan.from_wire(w)


def test_tensor_parallel_columns_and_replicas():
    """2 TP ranks: w1 column-parallel (rows), w2 row-parallel (columns), the rest replicated: each
    replica is sent by one rank, the replicas spread over both."""
    sd = model_sd()
    full = BucketPlan.from_state_dict(sd, 128)
    boxes, tensors = [[], []], [[], []]
    for r in range(2):
        for k, t in sd.items():
            if k == "w1":
                a, m = rows(t, 2)[r]
                box, part = (k, (a, 0), (m, 6)), t[a:a + m]
            elif k == "w2":
                box, part = (k, (0, 4 * r), (6, 4)), t[:, 4 * r:4 * r + 4].contiguous()
            else:
                box, part = (k, (0,) * t.dim(), tuple(t.shape)), t
            boxes[r].append(box)
            tensors[r].append(part)
    plan = ShardPlan.build(full, boxes)
    assert {p.rank for p in plan.pieces if p.name in ("emb", "norm", "scale")} == {0, 1}
    assert sum(off >= 0 for s in plan.slots for off in s) == len(plan.pieces) == 7
    got = round_trip(full, plan, tensors)
    assert all(torch.equal(got[k], sd[k]) for k in sd)


def test_bad_holdings_are_refused_naming_the_tensor():
    sd = model_sd()
    full = BucketPlan.from_state_dict(sd, 128)
    boxes, _ = fsdp(sd, 2)
    with pytest.raises(PlanMismatchError, match="'w1'.*cover"):
        ShardPlan.build(full, [boxes[0], [b for b in boxes[1] if b[0] != "w1"]])
    overlap = [[*boxes[0], ("w1", (3, 0), (1, 6))], boxes[1]]
    with pytest.raises(PlanMismatchError, match="'w1'.*overlap"):
        ShardPlan.build(full, overlap)
    with pytest.raises(PlanMismatchError, match="does not fit tensor 'w2'"):
        ShardPlan.build(full, [[*boxes[0], ("w2", (0, 0), (7, 8))], boxes[1]])
    with pytest.raises(PlanMismatchError, match="'nope'"):
        ShardPlan.build(full, [[("nope", (0,), (1,))]])


def test_reads_give_a_tensor_parallel_engine_its_slice():
    """The hook for a vLLM engine with tensor_parallel_size 2: rank 1 of it needs w1's rows 4..6 and
    w2's columns 4..7; the reads fill exactly that slice from the trainer ranks' pieces."""
    sd = model_sd()
    full = BucketPlan.from_state_dict(sd, 128)
    boxes, tensors = fsdp(sd, 3)
    plan = ShardPlan.build(full, boxes)
    flats = [torch.zeros(n, dtype=torch.uint8) for n in plan.totals]
    for r in range(3):
        plan.pack(r, tensors[r], flats[r])
    need = {"w1": ((4, 0), (3, 6)), "w2": ((0, 4), (6, 4))}
    out = {k: torch.full(box[1], float("nan"), dtype=torch.bfloat16) for k, box in need.items()}
    reads = plan.reads(need)
    assert {rd.piece.name for rd in reads} == set(need)
    for rd in reads:
        p = rd.piece
        src = flats[p.rank][p.offset:p.offset + p.nbytes].view(torch.bfloat16).view(p.size)
        sl = lambda box: tuple(slice(a, a + m) for a, m in zip(*box))  # noqa: E731
        out[p.name][sl(rd.dst)].copy_(src[sl(rd.src)])
    assert torch.equal(out["w1"], sd["w1"][4:7]) and torch.equal(out["w2"], sd["w2"][:, 4:])


@pytest.mark.parametrize("n", [2, 3])
def test_fused_qkv_shards_assemble_into_hf_q_k_v(n):
    """The real model's fused QKV weight sharded over n FSDP ranks (uneven with 3) splits into q/k/v
    runs whose assembly is exactly the exported HF weights."""
    model, adapter = build_model(model_dir(ModelConfig()))
    ref = export_hf(model, adapter, torch.bfloat16)
    full = BucketPlan.from_state_dict(ref, 1 << 16)
    boxes, tensors = [[] for _ in range(n)], [[] for _ in range(n)]
    for name, p in model.named_parameters():
        for r, (a, m) in enumerate(rows(p, n)):
            if not m:
                continue
            t, start, size = p.detach()[a:a + m], (a, *[0] * (p.dim() - 1)), (m, *p.shape[1:])
            if ".wqkv." in name:
                runs = _qkv_runs(model, adapter, name, start, size, t)
            else:
                runs = [((k, start, size), t) for k in adapter.to_hf({name: None})]
            boxes[r] += [b for b, _ in runs]
            tensors[r] += [x for _, x in runs]
    plan = ShardPlan.build(full, boxes)
    got = round_trip(full, plan, tensors)
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    assert any(".k_proj." in p.name for p in plan.pieces if p.rank == n - 1)
