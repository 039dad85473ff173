"""Models: tiny Qwen3 HF assets, the torchtitan model that trains them, HF <-> torchtitan names.

    hf_dir = model_dir(cfg.model)                  # a real HF dir, or tiny assets built once
    model, adapter = build_model(hf_dir)           # torchtitan Qwen3 on CPU, SDPA attention, loaded
    hf_sd = export_hf(model, adapter)              # HF names, what vLLM loads
    lp = token_logprobs(model, input_ids)          # [N, T-1] logprob of token t+1 given <= t

The tiny checkpoint is a real Qwen3 directory (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json): trainer (torchtitan), sampler (vLLM) and the
reference (HF transformers) all load the same files. Its tokenizer is character level (a BPE model
with no merges), which suits the built-in string tasks. A real checkpoint is any local Qwen3 HF
directory; nothing here downloads. The tokenizer side (special ids, prompts, chat templates) is
pipeline/tokens.py.

Run `python -m pipeline.model [--out DIR]` to build the tiny assets by hand.
"""

from __future__ import annotations

import hashlib
import json
import os
import string
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from pipeline.config import ModelConfig, TinyModelConfig

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
TINY_PAD_ID, TINY_BOS_ID, TINY_EOS_ID, TINY_UNK_ID = 0, 1, 2, 3
"""The tiny tokenizer's special ids, which its files are written with. Code reads a checkpoint's ids
from its files (pipeline.tokens.SpecialTokens), never these."""
CHARS = string.ascii_lowercase + string.digits + " +-*=?.,:;()rev"
ROPE_THETA = 1_000_000.0
NORM_EPS = 1e-6
_ASSET_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class ModelError(ValueError):
    """A checkpoint directory that cannot be used, with the reason."""


# ---------------------------------------------------------------- tiny assets


def tiny_vocab() -> dict[str, int]:
    """The tiny tokenizer's vocabulary: special tokens, then CHARS."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        vocab.setdefault(ch, len(vocab))
    return vocab


def padded_vocab_size(n: int) -> int:
    """The embedding rows for `n` tokens: a multiple of 64."""
    return (n + 63) // 64 * 64


def build_tokenizer_json(path: Path) -> None:
    """Character-level tokenizer: BPE with an empty merge list, Fuse decoder (no added spaces)."""
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.BPE(vocab=tiny_vocab(), merges=[], unk_token="<unk>"))
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.decoder = decoders.Fuse()
    tok.save(str(path))


def hf_config(t: TinyModelConfig, vocab_size: int) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": t.dim,
        "intermediate_size": t.ffn_dim,
        "num_hidden_layers": t.n_layers,
        "num_attention_heads": t.n_heads,
        "num_key_value_heads": t.n_kv_heads,
        "head_dim": t.dim // t.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": t.max_seq_len,
        "rms_norm_eps": NORM_EPS,
        "rope_theta": ROPE_THETA,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "bos_token_id": TINY_BOS_ID,
        "eos_token_id": TINY_EOS_ID,
        "pad_token_id": TINY_PAD_ID,
        "torch_dtype": "float32",
    }


def tiny_dir(cfg: ModelConfig) -> Path:
    """Cache folder keyed by the tiny shape and tokenizer, so a changed shape never reuses old files."""
    key = json.dumps({"tiny": asdict(cfg.tiny), "chars": CHARS, "format": 1}, sort_keys=True)
    return Path(cfg.cache_dir) / hashlib.sha256(key.encode()).hexdigest()[:12]


def ensure_tiny_assets(cfg: ModelConfig) -> Path:
    """Build the tiny Qwen3 checkpoint deterministically from `cfg.tiny.seed`, once; return its dir."""
    out = tiny_dir(cfg)
    if all((out / f).is_file() for f in _ASSET_FILES):
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    vocab_size = padded_vocab_size(len(tiny_vocab()))
    conf = hf_config(cfg.tiny, vocab_size)
    (tmp / "config.json").write_text(json.dumps(conf, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": TINY_BOS_ID, "eos_token_id": TINY_EOS_ID, "pad_token_id": TINY_PAD_ID}, indent=2))
    build_tokenizer_json(tmp / "tokenizer.json")
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "model_max_length": cfg.tiny.max_seq_len, "clean_up_tokenization_spaces": False,
    }, indent=2))
    with torch.random.fork_rng():
        torch.manual_seed(cfg.tiny.seed)
        model, adapter = _build_titan(conf, init=True)
    sd = {k: v.detach().contiguous().clone() for k, v in adapter.to_hf(model.state_dict()).items()}
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    try:
        tmp.rename(out)  # atomic publish; a concurrent builder may have won the race
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def model_dir(cfg: ModelConfig) -> Path:
    """The HF directory to use: `cfg.hf_dir` when set (checked), else the tiny assets."""
    if not cfg.hf_dir:
        return ensure_tiny_assets(cfg)
    d = Path(cfg.hf_dir)
    missing = [f for f in ("config.json", "tokenizer.json") if not (d / f).is_file()]
    if not d.is_dir() or missing or not list(d.glob("*.safetensors")):
        raise ModelError(f"model.hf_dir={str(d)!r} is not a HF checkpoint directory "
                         f"(needs config.json, tokenizer.json and *.safetensors; missing {missing or 'safetensors'})")
    return d


# ---------------------------------------------------------------- torchtitan model


def read_hf_config(hf_dir: Path) -> dict:
    conf = json.loads((Path(hf_dir) / "config.json").read_text())
    if conf.get("model_type") != "qwen3":
        raise ModelError(f"{hf_dir}: model_type={conf.get('model_type')!r}; this build supports 'qwen3' checkpoints")
    if conf.get("rope_scaling"):
        raise ModelError(f"{hf_dir}: rope_scaling={conf['rope_scaling']!r} is not supported")
    return conf


def titan_config(conf: dict):
    """torchtitan Qwen3 config matching a HF config.json, with causal SDPA (CPU has no Flex backward)."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_layers, _qwen3_norm

    dim, vocab = conf["hidden_size"], conf["vocab_size"]
    head_dim = conf.get("head_dim") or dim // conf["num_attention_heads"]
    init = {"weight": lambda w: torch.nn.init.normal_(w, std=0.02)}
    layers = _build_qwen3_layers(
        n_layers=conf["num_hidden_layers"], dim=dim, n_heads=conf["num_attention_heads"],
        n_kv_heads=conf["num_key_value_heads"], head_dim=head_dim, hidden_dim=conf["intermediate_size"],
        fuse_qkv=True, attn_backend="flex",
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=conf["max_position_embeddings"],
                               theta=float(conf.get("rope_theta", ROPE_THETA))),
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    tied = bool(conf.get("tie_word_embeddings", False))
    return Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=_qwen3_norm(dim), enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=init),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=init),
        layers=layers,
    )


def _build_titan(conf: dict, init: bool, hf_dir: Path | None = None):
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter

    tcfg = titan_config(conf)
    model = tcfg.build()
    if init:
        model.init_states(buffer_device=torch.device("cpu"))
    adapter = Qwen3StateDictAdapter(tcfg, str(hf_dir) if hf_dir else None)
    return model, adapter


def load_hf_state_dict(hf_dir: Path) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return sd


def build_model(hf_dir: Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """The torchtitan model for `hf_dir` with its weights loaded; returns (model, state_dict_adapter)."""
    conf = read_hf_config(hf_dir)
    model, adapter = _build_titan(conf, init=True, hf_dir=Path(hf_dir))
    titan_sd = adapter.from_hf(load_hf_state_dict(hf_dir))
    missing, unexpected = model.load_state_dict(titan_sd, strict=False)
    # RoPE caches are buffers computed at init, not checkpoint contents.
    missing = [k for k in missing if "rope" not in k and "freqs" not in k]
    if missing or unexpected:
        raise ModelError(f"{hf_dir}: checkpoint does not match the model: missing={missing[:5]} "
                         f"unexpected={unexpected[:5]}")
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


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache-dir", default=ModelConfig.cache_dir)
    args = ap.parse_args()
    print(ensure_tiny_assets(ModelConfig(cache_dir=args.cache_dir)))
