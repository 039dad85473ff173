"""The trainer's model: a checkpoint directory in, a loaded torchtitan model out, HF-named weights back.

    cfg = resolved(cfg)                            # at start-up: a builtin: model.hf_dir -> its folder
    hf_dir = model_dir(cfg.model)                  # the checked HF dir (a builtin: name built once)
    arch = read_arch(hf_dir)                       # its checked config (pipeline/models: one module per family)
    model, adapter = build_model(hf_dir)           # torchtitan model on CPU, SDPA attention, loaded
    hf_sd = export_hf(model, adapter)              # HF names, what vLLM loads
    lp = token_logprobs(model, input_ids)          # [N, T-1] logprob of token t+1 given <= t

Which architectures load, and how, is the registry in pipeline/models/__init__.py (keyed by config.json's
model_type); the built-in checkpoints are its BUILTIN. Nothing here downloads. The tokenizer side
(special ids, prompts, chat templates) is pipeline/tokens.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from pipeline.config import Config, ModelConfig
from pipeline.models import Arch, ModelError, family, read_arch, read_config, resolve_builtin

__all__ = ["build_model", "check_model", "check_weights", "export_hf", "load_hf_state_dict", "model_dir",
           "read_hf_config", "resolved", "save_hf_checkpoint", "token_logprobs", "tokenizer_hash"]


def resolved(cfg: Config) -> Config:
    """`cfg` with model.hf_dir a directory: a BUILTIN name (pipeline/models) replaced by the absolute folder
    it builds once, so that every process of the run and its checkpoints name that folder. Called where a
    loaded config is first used (pipeline/run.py main, Session.start); ModelError when it cannot be built."""
    hf_dir = resolve_builtin(cfg.model.hf_dir)
    if hf_dir == cfg.model.hf_dir:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_dir=hf_dir))


def model_dir(cfg: ModelConfig) -> Path:
    """The HF directory `cfg.hf_dir` names (a BUILTIN name: the folder it builds once), checked."""
    d = Path(resolve_builtin(cfg.hf_dir))
    missing = [f for f in ("config.json", "tokenizer.json") if not (d / f).is_file()]
    if not d.is_dir() or missing or not list(d.glob("*.safetensors")):
        raise ModelError(f"model.hf_dir={str(d)!r} is not a HF checkpoint directory "
                         f"(needs config.json, tokenizer.json and *.safetensors; missing {missing or 'safetensors'})")
    return d


def check_model(cfg: ModelConfig) -> Arch:
    """The checked architecture of the run's model, from files only (the CLI calls it before anything
    starts): ModelError naming the directory, the field, its value and what is supported, or a
    weights file that is cut short."""
    d = model_dir(cfg)
    arch = read_arch(d)
    why = check_weights(d)
    if why is not None:
        raise ModelError(f"model.hf_dir={cfg.hf_dir!r}: {why}")
    return arch


def check_weights(hf_dir: Path) -> str | None:
    """Why the *.safetensors files of `hf_dir` cannot be whole (none; a header that cannot be read; a
    file shorter than its header says: a truncated copy), or None. Reads headers only."""
    import struct

    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        return "no *.safetensors weights file"
    for f in files:
        size = f.stat().st_size
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                if n > size - 8:
                    return f"{f.name}: its header says {n} bytes, the file has {size} (truncated)"
                header = json.loads(fh.read(n))
        except (struct.error, ValueError, UnicodeDecodeError) as e:
            return f"{f.name}: not a readable safetensors file ({type(e).__name__}: {e})"
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end > size:
            return f"{f.name} has {size} bytes, its header describes {8 + n + end} (truncated)"
    return None


def tokenizer_hash(hf_dir: str | Path) -> str:
    """sha256 of the tokenizer files of `hf_dir` (tokenizer*, vocab*, merges*, special_tokens*): names and bytes."""
    h = hashlib.sha256()
    for p in sorted(p for p in Path(hf_dir).iterdir()
                    if p.name.startswith(("tokenizer", "vocab", "merges", "special_tokens"))):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def read_hf_config(hf_dir: Path) -> dict:
    """config.json of `hf_dir`, checked by its family (ModelError when this build cannot train it)."""
    read_arch(hf_dir)
    return read_config(hf_dir)


def load_hf_state_dict(hf_dir: Path) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return sd


def build_model(hf_dir: Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """The torchtitan model for `hf_dir` with its weights loaded; returns (model, state_dict_adapter).
    RoPE stays float32 frequencies whatever `dtype` (pipeline/models/rope.py)."""
    arch = read_arch(hf_dir)
    fam = family(arch)
    model, adapter = fam.build(arch), fam.adapter(arch)
    titan_sd = adapter.from_hf(load_hf_state_dict(hf_dir))
    missing, unexpected = model.load_state_dict(titan_sd, strict=False)
    if missing or unexpected:
        raise ModelError(f"{hf_dir}: checkpoint does not match its config.json ({arch.model_type}): "
                         f"missing={missing[:5]} unexpected={unexpected[:5]}")
    return model.to(device=device, dtype=dtype), adapter


def export_hf(model: torch.nn.Module, adapter, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Model weights under HF names (full tensors; DTensors are gathered), in `dtype` when given: each
    shard is cast before its gather, so a bf16 export of float32 master weights moves half the bytes
    and equals the full master cast to bf16 (an elementwise cast commutes with the gather)."""
    from torch.distributed.tensor import DTensor

    sd = {}
    for k, v in model.state_dict().items():
        if ".lora_" in k:  # LoRA adapters: pipeline/lora.py
            continue
        v = v.detach() if dtype is None else v.detach().to(dtype)
        sd[k] = v.full_tensor() if isinstance(v, DTensor) else v
    return adapter.to_hf(sd)


def save_hf_checkpoint(model: torch.nn.Module, adapter, src_dir: Path, out_dir: Path,
                       dtype: torch.dtype | None = None) -> Path:
    """Write an HF directory vLLM can load: weights from `model` (cast to `dtype` when given),
    everything else copied from `src_dir`."""
    import shutil

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in Path(src_dir).iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out_dir / f.name)
    sd = {k: v.contiguous().cpu().clone() for k, v in export_hf(model, adapter, dtype).items()}
    save_file(sd, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    if dtype is not None:  # config.json names the dtype the weights are in (HF's torch_dtype="auto" reads it)
        conf = json.loads((out_dir / "config.json").read_text())
        (out_dir / "config.json").write_text(json.dumps({**conf, "torch_dtype": str(dtype).removeprefix("torch.")},
                                                        indent=2))
    return out_dir


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """[N, T-1]: logprob of input_ids[:, t+1] given input_ids[:, :t+1] (right-padded batches)."""
    logits = model(input_ids).float()
    return torch.gather(F.log_softmax(logits[:, :-1], dim=-1), 2, input_ids[:, 1:, None]).squeeze(-1)

