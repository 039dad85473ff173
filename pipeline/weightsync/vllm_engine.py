"""vLLM weight-transfer backend `monarch_rl`: runs inside vLLM's engine/worker process.

Registered by `vllm_plugin.register()` (entry point group `vllm.general_plugins`), selected with
`weight_transfer_config={"backend": "monarch_rl"}`. `update_weights` receives the name of a
shared-memory segment staged by a WeightReceiver (or the trainer's own shm slot), maps it once,
checks its header (version, plan hash), hands zero-copy views to the model's `load_weights` under
vLLM's layerwise reload (start/finish), and re-checks the header so a torn read raises. An update
naming `hf_dir` instead loads the safetensors files of an HF export of the model the same way (the
auto warm start's chunks, pipeline/weightsync/load.py load_export).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from pipeline.weightsync import segment as segmod
from pipeline.weightsync.errors import PlanMismatchError
from pipeline.weightsync.plan import BucketPlan

BACKEND = "monarch_rl"


@dataclass
class MonarchRLInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: segments are named per update."""


@dataclass
class MonarchRLUpdateInfo(WeightTransferUpdateInfo):
    segment: str
    version: int
    plan: dict[str, Any] = field(default_factory=dict)
    hf_dir: str = ""
    """Instead of a segment: an HF export's directory, its *.safetensors loaded whole."""


class MonarchRLWeightTransferEngine(WeightTransferEngine[MonarchRLInitInfo, MonarchRLUpdateInfo]):
    init_info_cls = MonarchRLInitInfo
    update_info_cls = MonarchRLUpdateInfo

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._segments: dict[str, segmod.Segment] = {}
        self._plans: dict[str, BucketPlan] = {}
        self._version: int | None = None

    def init_transfer_engine(self, init_info: MonarchRLInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        self._version = None
        start_reload(self.model)

    def receive_weights(self, info: MonarchRLUpdateInfo) -> None:
        if info.hf_dir:
            self._load_export(Path(info.hf_dir))
        else:
            self.load_into(self.model, info)
        self._version = info.version

    def finish_weight_update(self) -> None:
        finish_reload(self.model, self.model_config, self._version)

    def load_into(self, model: torch.nn.Module, info: MonarchRLUpdateInfo) -> None:
        """Hand the staged segment's tensors (zero-copy views on CPU) to `model.load_weights`, armed for
        layerwise reload (`start_reload`); the header is checked before and after, so a torn read raises.
        `model` is the served one, or the shadow copy (pipeline/weightsync/shadow.py)."""
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        plan = self._plans.get(info.plan.get("hash", ""))
        if plan is None:
            plan = self._plans.setdefault(info.plan["hash"], BucketPlan.from_wire(info.plan))
        seg = self._segment(info.segment, plan.total_bytes)
        where = f"segment {info.segment}"
        segmod.check_header(seg.header, info.version, plan.hash_int, where)
        src = seg.data if self.device.type == "cpu" else seg.data.to(self.device, non_blocking=True)
        with disable_mtp_completeness_check():
            model.load_weights(plan.unpack(src, info.version))
        segmod.check_header(seg.header, info.version, plan.hash_int, where, after_read=True)

    def _load_export(self, hf_dir: Path) -> None:
        """Every *.safetensors of `hf_dir` into the served model (armed by `start_reload`)."""
        from safetensors.torch import load_file
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        files = sorted(hf_dir.glob("*.safetensors"))
        if not files:
            raise PlanMismatchError(f"{hf_dir}: no *.safetensors to load")
        for f in files:
            sd = load_file(str(f), device=str(self.device))
            with disable_mtp_completeness_check():
                self.model.load_weights(iter(sd.items()))

    def _segment(self, name: str, size: int) -> segmod.Segment:
        seg = self._segments.get(name)
        if seg is None or seg.size < size:
            if seg is not None:
                seg.close()
            seg = self._segments[name] = segmod.Segment(name, size, create=False)
        return seg

    def shutdown(self) -> None:
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()


def start_reload(model: torch.nn.Module) -> None:
    """Arm every layer of `model` for vLLM's layerwise reload: its kernel tensors are kept, its
    parameters go back to checkpoint format (on meta) and each layer is processed
    (process_weights_after_loading: fused qkv / gate_up, CPU packing) once all its weights arrived."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(model)


def finish_reload(model: torch.nn.Module, model_config, version: int | None) -> None:
    """Process what is left (tied layers, attention) and disarm; PlanMismatchError if a layer got no
    weights and would keep its old ones."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    unloaded = load_tied_layers(model)
    finalize_layerwise_reload(model, model_config)
    if unloaded:  # finalize put the old tensors back for these layers: a half-new model
        raise PlanMismatchError(f"version {version}: layers received no weights and would keep "
                                f"old ones: {unloaded[:5]} ({len(unloaded)} in all)")


def load_tied_layers(model: torch.nn.Module) -> list[str]:
    """Feed layers that got no weights but alias a reloaded one (tied lm_head); return the rest.

    The model's `load_weights` skips a tied `lm_head`, and layerwise reload would then restore its
    old kernel tensors (on CPU a separately packed copy), serving stale logits. We load it from
    the live tensor it aliases so it is reprocessed like any other layer.
    """
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    armed, live = [], {}
    for name, layer in model.named_modules():
        info = get_layerwise_info(layer)
        params = (info.kernel_tensors or ({}, {}))[0]
        if info.can_load() and info.load_numel <= 0 and params and not is_deferred_attention_layer(layer):
            armed.append((name, layer, params))
        elif not info.can_load():  # processed: its parameters are live again
            live.update((p.data_ptr(), p) for p in layer.parameters(recurse=False))
    unloaded = []
    for name, layer, params in armed:
        if not all(p.data_ptr() in live for p in params.values()):
            unloaded.append(name)  # buffers-only layers have no params, so never land here
            continue
        for pname, kernel in params.items():
            param = getattr(layer, pname)
            param.weight_loader(param, live[kernel.data_ptr()].detach().clone())
    return unloaded
