"""What a vLLM engine serves, read back inside its worker process: checksums per vLLM parameter
(weight_sync.verify), and the start-up corruption that the first push must undo.

Runs in vLLM's worker as a worker extension (`vllm_engine_kwargs` sets
`worker_extension_cls`), called through `collective_rpc` by method name; the engine-client side
is `pipeline/weightsync/verify.py`. Only tensor_parallel_size 1 (config checks).

Granularity: per vLLM parameter, under its vLLM name. A fused parameter (qkv_proj = q‖k‖v,
gate_up_proj = gate‖up, from the model's `packed_modules_mapping`) is reported with the HF names
it concatenates, in order, so the trainer's per-HF-tensor checksums compose into its reference
(checksum.concat) with no copy on either side.

What "served" means: the tensor the forward computes with. On GPU that is each parameter. vLLM's
CPU backend repacks every Linear weight for its GEMM kernel (oneDNN) and empties the parameter, so
there the weight is read through the kernel itself: the layer's `quant_method.apply` on an identity
matrix gives Wᵀ exactly (each output is one product by 1.0 plus products by 0, accumulated in
float32, then rounded to a dtype that holds it). The LM head's packed copy is read the same way
(`<name>.weight@kernel`, tied: checked against the embedding), since a stale copy there serves old
logits with a correct-looking parameter. Two values do not survive the kernel: −0.0 reads as +0.0
and a subnormal as 0 (the bf16 dot-product instructions flush them, in the forward as here), so
such a weight fails the check; trained weights never hold them in practice. Where oneDNN cannot
make a kernel for a shape (the small llama/qwen2 test models' fused projections), vLLM keeps the
parameter and computes with torch's linear: the parameter is checked, and read through the layer as
`<name>.weight@kernel` against the same HF parts. A bias that vLLM's AMX kernel widened to float32
is checked in its loaded dtype. The kernel read costs
in_features × the layer's weights multiply-adds (the shrunk test models: milliseconds; a 0.6B model
on CPU: seconds), which is why verify can run every k-th push.

Example (in the engine's client process):
    out = (await llm.collective_rpc("monarch_rl_checksums"))[0]   # {"tensors": {...}, "parts": {...}}
    (await llm.collective_rpc("monarch_rl_corrupt"))[0]            # names the corruption did not change
"""

from __future__ import annotations

from typing import Iterator

import torch
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

from pipeline.weightsync import checksum

KERNEL = "@kernel"
"""Suffix of a weight read through its CPU kernel while its parameter is kept (the LM head)."""

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ServedWeights:
    """vLLM worker extension: its methods join the worker's (hence the prefix: no clash)."""

    def monarch_rl_checksums(self) -> dict:
        """{"tensors": name -> checksum (wire form), "parts": name -> HF names it concatenates}."""
        model = self.model_runner.get_model()
        tensors, parts = {}, {}
        for name, t, srcs in served_tensors(model):
            tensors[name] = checksum.of_tensor(t).to_wire()
            if srcs != [name]:
                parts[name] = srcs
        return {"tensors": tensors, "parts": parts}

    def monarch_rl_corrupt(self) -> list[str]:
        """Flip the lowest bit of every element of every served tensor (parameters in place, kernel
        copies re-packed from the flipped weights, as a load's post-processing does); returns the
        names whose checksum did not change (empty: the corruption reached everything served)."""
        model = self.model_runner.get_model()
        before = {n: checksum.of_tensor(t) for n, t, _ in served_tensors(model)}
        with torch.no_grad():
            for _, p in model.named_parameters():
                if p.numel():
                    _flip(p.data)
            for _, m in _kernel_layers(model):
                if m.weight.numel() == 0:  # the kernel holds the only copy: read, flip, hand back
                    w = _through_kernel(m).t().contiguous()
                    _flip(w)
                    m.weight.data = w
                m.quant_method.process_weights_after_loading(m)  # re-packs (and empties) as a load does
        after = {n: checksum.of_tensor(t) for n, t, _ in served_tensors(model)}
        return sorted(n for n in before if after.get(n) == before[n])


def served_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, list[str]]]:
    """(vLLM name, tensor as served, the HF names it concatenates) for every served weight."""
    fused = dict(getattr(model, "packed_modules_mapping", None) or {})
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    widened = {f"{n}.bias": m.params_dtype for n, m in _kernel_layers(model)}
    for name, p in model.named_parameters():
        if p.numel():
            yield name, _as_loaded(p.data, widened.get(name)), _sources(name, fused)
    for mname, m in _kernel_layers(model):
        if m.weight.numel() == 0:
            name = f"{mname}.weight"
            yield name, _through_kernel(m).t(), _sources(name, fused)
        else:  # a kernel beside the kept parameter (the tied LM head's packed copy; a fused projection whose
            # oneDNN kernel could not be made and computes from the parameter): it must hold its bytes
            yield f"{mname}.weight{KERNEL}", _through_kernel(m).t(), _sources(first[id(m.weight)], fused)


def _sources(name: str, fused: dict[str, list[str]]) -> list[str]:
    for packed, subs in fused.items():
        if f".{packed}." in name:
            return [name.replace(f".{packed}.", f".{s}.") for s in subs]
    return [name]


def _as_loaded(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A kernel layer's bias in the dtype it was loaded in: vLLM's AMX kernel (sgl weight_packed_linear)
    keeps it widened to float32, which holds the loaded values exactly; one that does not round-trip
    is returned as it is (and fails the check, as it should)."""
    if dtype is None or t.dtype == dtype or t.dtype != torch.float32:
        return t
    narrow = t.to(dtype)
    return narrow if torch.equal(narrow.float(), t) else t


def _kernel_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """Layers whose forward multiplies through a CPU kernel's own packed copy of the weight."""
    for name, m in model.named_modules():
        if isinstance(m, (LinearBase, ParallelLMHead)) and callable(getattr(m, "cpu_linear", None)):
            yield name, m


def _through_kernel(m: torch.nn.Module) -> torch.Tensor:
    """Wᵀ [in, out] as the layer's kernel computes with it: the layer applied to the identity."""
    k = m.embedding_dim if isinstance(m, ParallelLMHead) else m.input_size
    eye = torch.eye(k, dtype=m.params_dtype, device=m.weight.device)
    return m.quant_method.apply(m, eye)


def _flip(t: torch.Tensor) -> None:
    t.view(_INT[t.element_size()]).bitwise_xor_(1)
