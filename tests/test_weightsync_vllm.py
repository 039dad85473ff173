"""A version pushed through WeightSender/WeightReceiver into a live vLLM AsyncLLM is really served.

One AsyncLLM (engine core in a child process) is shared by the module. The invariant: after a sync,
vLLM's logprobs of a fixed sequence equal torchtitan's for the same (perturbed) weights, differ from
the pre-sync ones, and the engine reports the pushed version.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch

from pipeline.config import WeightSyncConfig
from pipeline.models.hf import build_model, export_hf, token_logprobs
from pipeline.tokens import load_tokenizer
from pipeline.generator.llm import stop_engine
from pipeline.weightsync import (VersionRegressionError, WeightLoadError, WeightReceiver, WeightSender,
                                 load_into_vllm, vllm_engine_kwargs)
from pipeline.weightsync.load import INVALID_PREFIX

pytestmark = pytest.mark.slow
PROMPT = "rev hello world="
COMPLETION = "dlrow olleh"


@pytest.fixture(scope="module")
def engine(tiny_dir, loop):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from pipeline.generator.llm import start_llm

    args = AsyncEngineArgs(model=str(tiny_dir), dtype="float32", enforce_eager=True, max_model_len=256,
                           seed=0, **vllm_engine_kwargs())

    async def start():
        return start_llm(args)

    llm = loop.run_until_complete(start())
    yield llm
    stop_engine(llm)


def vllm_logprobs(loop, llm, ids: list[int]) -> torch.Tensor:
    from vllm import SamplingParams, TokensPrompt

    async def run():
        sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        out = None
        async for out in llm.generate(TokensPrompt(prompt_token_ids=ids), sp, request_id=f"r{os.urandom(4).hex()}"):
            pass
        return out

    out = loop.run_until_complete(asyncio.wait_for(run(), 120))
    return torch.tensor([out.prompt_logprobs[t][ids[t]].logprob for t in range(1, len(ids))])


def perturbed(hf_sd: dict[str, torch.Tensor], seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * v.std().nan_to_num(0) * torch.randn(v.shape, generator=g, dtype=v.dtype)
            if v.is_floating_point() and v.numel() > 1 else v.clone() for k, v in hf_sd.items()}


def test_synced_weights_are_served_by_vllm(tiny_dir, engine, loop):
    model, adapter = build_model(tiny_dir)
    tok = load_tokenizer(tiny_dir)
    ids = tok(PROMPT + COMPLETION)["input_ids"]
    before = vllm_logprobs(loop, engine, ids)

    cfg = WeightSyncConfig(transport="shm", bucket_mb=1, timeout_s=60)
    hf_sd = export_hf(model, adapter)
    sender = WeightSender(cfg, hf_sd, num_receivers=1)
    receiver = WeightReceiver(sender.handle(), rank=0)
    try:
        for version, seed in ((1, 1), (2, 2)):
            new_sd = perturbed(hf_sd, seed)
            model.load_state_dict(adapter.from_hf(dict(new_sd)), strict=False)  # from_hf mutates its input
            with torch.no_grad():
                ref = token_logprobs(model, torch.tensor([ids]))[0]

            async def sync():
                await asyncio.gather(sender.push(new_sd, version), receiver.pull(version))
                await load_into_vllm(engine, receiver, version, timeout_s=60)

            loop.run_until_complete(sync())
            after = vllm_logprobs(loop, engine, ids)
            assert loop.run_until_complete(engine.get_weight_version()) == str(version)
            assert receiver.loaded_version == version
            assert (after - ref).abs().max().item() <= 1e-3, (version, after, ref)
            assert (after - before).abs().max().item() > 1e-2, "vLLM still serves the old weights"
            before = after

        with pytest.raises(VersionRegressionError, match="version 1"):
            loop.run_until_complete(receiver.pull(1))
    finally:
        receiver.close()
        sender.close()


def test_failed_load_is_loud_unclaimed_and_recoverable(tiny_dir, engine, loop):
    """Breaking the slot-reuse rule (two pushes while a version sits staged) fails the load; the engine
    then claims no version, and the next good load serves again."""
    model, adapter = build_model(tiny_dir)
    ids = load_tokenizer(tiny_dir)(PROMPT + COMPLETION)["input_ids"]
    hf_sd = export_hf(model, adapter)
    sender = WeightSender(WeightSyncConfig(transport="shm", bucket_mb=1, timeout_s=60), hf_sd, num_receivers=1)
    receiver = WeightReceiver(sender.handle(), rank=0)
    try:
        async def stale_load():
            await asyncio.gather(sender.push(perturbed(hf_sd, 10), 10), receiver.pull(10))
            await sender.push(perturbed(hf_sd, 11), 11)
            await sender.push(perturbed(hf_sd, 12), 12)  # reuses the slot version 10 is staged in
            await load_into_vllm(engine, receiver, 10, timeout_s=60)

        with pytest.raises(WeightLoadError, match="version 10"):
            loop.run_until_complete(stale_load())
        assert loop.run_until_complete(engine.get_weight_version()) == f"{INVALID_PREFIX}10"
        assert receiver.loaded_version != 10

        new_sd = perturbed(hf_sd, 13)

        async def good_load():
            await asyncio.gather(sender.push(new_sd, 13), receiver.pull(13))
            await load_into_vllm(engine, receiver, 13, timeout_s=60)

        loop.run_until_complete(good_load())
        model.load_state_dict(adapter.from_hf(dict(new_sd)), strict=False)
        with torch.no_grad():
            ref = token_logprobs(model, torch.tensor([ids]))[0]
        assert loop.run_until_complete(engine.get_weight_version()) == "13"
        assert (vllm_logprobs(loop, engine, ids) - ref).abs().max().item() <= 1e-3
    finally:
        receiver.close()
        sender.close()


def test_shadow_weights_load_while_generating_and_swap_bit_exact(tiny_dir, engine, loop):
    """generator.shadow_weights: the version loads into the worker's second copy while a request keeps
    producing tokens, the served model is untouched until the swap, and after it the served tensors
    equal the pushed ones bit for bit (read back in the worker), logprobs match the trainer's, and the
    running request's tokens carry the old version before the swap and the new one after it."""
    from vllm import SamplingParams, TokensPrompt

    from pipeline.weightsync import load_shadow, read_served, swap_into_vllm
    from pipeline.weightsync.load import pause_keep

    model, adapter = build_model(tiny_dir)
    ids = load_tokenizer(tiny_dir)(PROMPT + COMPLETION)["input_ids"]
    hf_sd = export_hf(model, adapter)
    sender = WeightSender(WeightSyncConfig(transport="shm", bucket_mb=1, timeout_s=60), hf_sd, num_receivers=1)
    receiver = WeightReceiver(sender.handle(), rank=0)
    old_version = loop.run_until_complete(engine.get_weight_version())  # "default", or an earlier test's
    before = vllm_logprobs(loop, engine, ids)
    try:
        async def run():
            version = 50
            new_sd = perturbed(hf_sd, 21)
            await asyncio.gather(sender.push(new_sd, version), receiver.pull(version))
            arrivals: list[float] = []
            seen = [0]  # tokens the request has delivered so far
            final = None

            async def long_request():
                nonlocal final
                sp = SamplingParams(max_tokens=200, temperature=1.0, ignore_eos=True, seed=0)
                async for out in engine.generate(TokensPrompt(prompt_token_ids=ids[:4]), sp, request_id="shadow-long"):
                    arrivals.append(time.monotonic())
                    seen[0] = len(out.outputs[0].token_ids)
                    final = out

            req = asyncio.ensure_future(long_request())
            while len(arrivals) < 3:  # decoding
                await asyncio.sleep(0.01)
            t0 = time.monotonic()
            await load_shadow(engine, receiver, version, timeout_s=60)
            t1 = time.monotonic()
            during = sum(t0 < t <= t1 for t in arrivals)
            assert await engine.get_weight_version() == old_version  # the copy is loaded, not served
            await pause_keep(engine)
            await swap_into_vllm(engine, receiver, version, timeout_s=60)
            n_swap = seen[0]  # every token delivered by now was sampled before the pause
            await engine.resume_generation()
            await asyncio.wait_for(req, 120)
            return version, new_sd, during, n_swap, final

        version, new_sd, during, n_swap, final = loop.run_until_complete(run())
        assert during >= 1, "no token was produced while the shadow copy loaded"
        spans = [(s.version, s.start, s.end) for s in final.outputs[0].weight_versions]
        assert [v for v, _, _ in spans] == [old_version, str(version)], spans
        assert n_swap <= spans[1][1] < 200, (spans, n_swap)  # no token sampled before the swap is tagged new
        names = ["model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"]
        served = loop.run_until_complete(read_served(engine, names))
        for n in names:
            assert torch.equal(served[n], new_sd[n].to(served[n].dtype)), n
        model.load_state_dict(adapter.from_hf(dict(new_sd)), strict=False)
        with torch.no_grad():
            ref = token_logprobs(model, torch.tensor([ids]))[0]
        after = vllm_logprobs(loop, engine, ids)
        assert (after - ref).abs().max().item() <= 1e-3
        assert (after - before).abs().max().item() > 1e-2, "vLLM still serves the old weights"
        assert receiver.loaded_version == version
    finally:
        receiver.close()
        sender.close()


def test_reload_in_place_empties_the_prefix_cache(tiny_dir, engine, loop, tmp_path):
    """load_export (the auto warm start's in-place reload, same version label, no pause around it):
    a prompt whose prefix the engine cached under the old weights is computed afresh on the new ones,
    so the next token's logprob is the trainer's for the new weights, not one from cached old KV."""
    from safetensors.torch import save_file
    from vllm import SamplingParams, TokensPrompt

    from pipeline.weightsync import load_export

    model, adapter = build_model(tiny_dir)
    hf_sd = export_hf(model, adapter)
    block = engine.vllm_config.cache_config.block_size
    ids = load_tokenizer(tiny_dir)(PROMPT * 20)["input_ids"][:min(2 * block + 3, 200)]
    assert len(ids) > block, "the prompt must fill a block for the prefix cache to hold it"

    def export(sd, name):
        (tmp_path / name).mkdir()
        save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / name / "model.safetensors"))
        return str(tmp_path / name)

    def next_token():
        """(token, its logprob, prompt tokens served from the prefix cache) of a greedy step."""
        async def run():
            out = None
            sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)
            rid = f"pc{os.urandom(4).hex()}"
            async for out in engine.generate(TokensPrompt(prompt_token_ids=ids), sp, request_id=rid):
                pass
            return out
        out = loop.run_until_complete(asyncio.wait_for(run(), 120))
        tok = out.outputs[0].token_ids[0]
        return tok, out.outputs[0].logprobs[0][tok].logprob, out.num_cached_tokens

    def trainer_logprob(sd, tok):
        model.load_state_dict(adapter.from_hf(dict(sd)), strict=False)
        with torch.no_grad():
            return token_logprobs(model, torch.tensor([ids + [tok]]))[0, -1].item()

    old_sd, new_sd = perturbed(hf_sd, 31, scale=0.5), perturbed(hf_sd, 32)  # far apart: stale KV shows
    loop.run_until_complete(load_export(engine, export(old_sd, "old"), 60, timeout_s=60))
    next_token()  # caches the prompt's full blocks under the old weights
    tok, lp_old, hit = next_token()
    assert hit >= block, "the engine does not reuse a cached prefix: this test would prove nothing"
    assert abs(lp_old - trainer_logprob(old_sd, tok)) <= 1e-3

    loop.run_until_complete(load_export(engine, export(new_sd, "new"), 60, timeout_s=60))
    assert loop.run_until_complete(engine.get_weight_version()) == "60"  # same label: nothing else tells them apart
    tok, lp_new, hit = next_token()
    ref = trainer_logprob(new_sd, tok)
    assert abs(lp_new - ref) <= 1e-3, f"served {lp_new:.5f}, fresh {ref:.5f}: the old weights' cached prefix was reused"
    assert hit == 0, f"{hit} prompt tokens came from KV cached under the old weights"
