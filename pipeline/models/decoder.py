"""The HF-layout dense decoder every supported family is: what a family reads from config.json (`Arch`),
the torchtitan model built from it, the HF <-> torchtitan names, the tensor-parallel plan, the LoRA
targets and the fused-QKV row layout. A family module (llama.py, qwen2.py, qwen3.py) reads and checks
its config.json into an Arch and names what is its own; everything here follows from the Arch.

    arch = FAMILIES[conf["model_type"]].read(conf, hf_dir)   # ModelError naming field, value, supported
    model = build(arch)                                      # torchtitan Decoder, causal SDPA, HF RoPE
    adapter = HFAdapter(arch)                                # to_hf / from_hf: HF names, HF row order

Layout: torchtitan's GQAttention with a fused QKV Linear laid out KV group by KV group (hpk query heads,
one key head, one value head; `qkv_split`), SwiGLU FFN (w1 gate, w3 up, w2 down), RMSNorms rounded in
bf16 as HF and vLLM round them (models/norm.py), and rotate-half RoPE (models/rope.py) applied to q/k in
HF's row order. The adapter is a plain rename: it
never permutes q/k rows (torchtitan's Llama 3 adapter does, for its complex RoPE; a push, a LoRA split
or a sharded box computed from permuted rows would be silently wrong while a bytes-only verify passes).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


class ModelError(ValueError):
    """A checkpoint directory that cannot be used, with the reason (one line)."""


@dataclass(frozen=True)
class Arch:
    """Everything of a checkpoint's config.json that changes the function the model computes."""

    model_type: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float
    rope_theta: float
    tied: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    llama3_rope: dict | None = field(default=None, hash=False)
    """Llama 3.1/3.2 RoPE scaling (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings), or None."""
    max_positions: int = 4096
    """max_position_embeddings: not part of the function (RoPE is computed per position)."""

    def fingerprint(self) -> dict[str, Any]:
        """What a resume must match, under HF config.json names (pipeline/checkpoint.py)."""
        return {"model_type": self.model_type, "vocab_size": self.vocab_size, "hidden_size": self.dim,
                "intermediate_size": self.ffn_dim, "num_hidden_layers": self.n_layers,
                "num_attention_heads": self.n_heads, "num_key_value_heads": self.n_kv_heads,
                "head_dim": self.head_dim, "tie_word_embeddings": self.tied, "rms_norm_eps": self.norm_eps,
                "rope_theta": self.rope_theta, "rope_scaling": self.llama3_rope,
                "attention_bias": self.qkv_bias, "qk_norm": self.qk_norm}


# ---------------------------------------------------------------- reading config.json


class Fields:
    """config.json of `where` for one family: typed reads that raise ModelError naming the field."""

    def __init__(self, conf: dict, where: str | Path, family: str) -> None:
        self.conf, self.where, self.family = conf, str(where), family

    def error(self, key: str, supported: str) -> ModelError:
        return ModelError(f"{self.where}: config.json {key}={self.conf.get(key)!r} is not supported for "
                          f"model_type={self.family!r}; supported: {supported}")

    def int(self, key: str, default: int | None = None) -> int:
        v = self.conf.get(key, default)
        if v is None:
            v = default
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise self.error(key, "a positive integer")
        return v

    def float(self, key: str, default: float) -> float:
        v = self.conf.get(key, default)
        v = default if v is None else v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise self.error(key, "a positive number")
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self.conf.get(key, default)
        v = default if v is None else v
        if not isinstance(v, bool):
            raise self.error(key, "true or false")
        return v

    def only(self, key: str, allowed: tuple, supported: str) -> None:
        """Refuse `key` unless it is absent or one of `allowed`."""
        if key in self.conf and self.conf[key] not in allowed:
            raise self.error(key, supported)


def read_common(f: Fields, *, qkv_bias: bool = False, qk_norm: bool = False, llama3_ok: bool = False,
                theta_default: float = 10000.0) -> Arch:
    """The fields every family shares; the family refuses its own extras before or after."""
    c = f.conf
    f.only("hidden_act", ("silu",), "'silu' (SwiGLU)")
    f.only("partial_rotary_factor", (1, 1.0, None), "1.0 (RoPE on the whole head)")
    if c.get("quantization_config") is not None:
        raise f.error("quantization_config", "none (a dense bf16/fp16/fp32 checkpoint: the trainer updates "
                      "every weight)")
    heads = f.int("num_attention_heads")
    dim = f.int("hidden_size")
    kv = f.int("num_key_value_heads", heads)
    if heads % kv:
        raise f.error("num_key_value_heads", f"a divisor of num_attention_heads={heads}")
    head_dim = f.int("head_dim", dim // heads)
    rope = c.get("rope_parameters") if isinstance(c.get("rope_parameters"), dict) else None  # transformers >= 5
    theta = f.float("rope_theta", theta_default) if rope is None or "rope_theta" not in rope \
        else float(rope["rope_theta"])
    scaling = c.get("rope_scaling") if rope is None else rope
    key = "rope_scaling" if rope is None else "rope_parameters"
    llama3 = None
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "llama3" and llama3_ok:
            try:
                llama3 = {k: float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor")}
                llama3["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
            except (KeyError, TypeError, ValueError):
                raise ModelError(f"{f.where}: config.json {key}={scaling!r} is not supported: rope_type 'llama3' "
                                 "needs factor, low_freq_factor, high_freq_factor and "
                                 "original_max_position_embeddings") from None
        elif kind not in (None, "default"):
            ok = "null, rope_type 'default' or 'llama3'" if llama3_ok else "null or rope_type 'default'"
            raise ModelError(f"{f.where}: config.json {key}={scaling!r} is not supported for "
                             f"model_type={f.family!r}; supported: {ok}")
    return Arch(model_type=f.family, vocab_size=f.int("vocab_size"), dim=dim, n_layers=f.int("num_hidden_layers"),
                n_heads=heads, n_kv_heads=kv, head_dim=head_dim, ffn_dim=f.int("intermediate_size"),
                norm_eps=f.float("rms_norm_eps", 1e-6), rope_theta=theta,
                tied=f.bool("tie_word_embeddings", False), qkv_bias=qkv_bias, qk_norm=qk_norm, llama3_rope=llama3,
                max_positions=f.int("max_position_embeddings", 4096))


def refuse_sliding_window(f: Fields) -> None:
    """Qwen2/Qwen3 window attention (HF applies it only with use_sliding_window, or per layer_types)."""
    f.only("use_sliding_window", (False, None), "false (full attention in every layer)")
    types = f.conf.get("layer_types")
    if types and any(t != "full_attention" for t in types):
        raise f.error("layer_types", "every layer 'full_attention'")


# ---------------------------------------------------------------- the torchtitan model


def titan_config(arch: Arch):
    """torchtitan Decoder config for `arch`: fused QKV, causal SDPA (CPU has no Flex backward), HF RoPE,
    RMSNorm rounded as HF rounds it."""
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.qwen3 import Qwen3Model, Qwen3TransformerBlock

    from pipeline.models.norm import HFRMSNorm
    from pipeline.models.rope import HFRoPE

    normal = {"weight": lambda w: torch.nn.init.normal_(w, std=0.02), "bias": torch.nn.init.zeros_}
    # HF's rounding in bf16 (pipeline/models/norm.py), torchtitan's RMSNorm and state dict otherwise
    norm = lambda n: HFRMSNorm.Config(normalized_shape=n, eps=arch.norm_eps,  # noqa: E731
                                      param_init={"weight": torch.nn.init.ones_})
    rope = HFRoPE.Config(head_dim=arch.head_dim, max_seq_len=arch.max_positions, theta=arch.rope_theta,
                         llama3=arch.llama3_rope)
    layers = []
    for _ in range(arch.n_layers):
        attn = make_gqa_config(dim=arch.dim, n_heads=arch.n_heads, n_kv_heads=arch.n_kv_heads,
                               head_dim=arch.head_dim, wqkv_param_init=normal, wo_param_init=normal,
                               inner_attention=ScaledDotProductAttention.Config(), fuse_qkv=True, rope=rope,
                               qk_norm=norm(arch.head_dim) if arch.qk_norm else None)
        attn.qkv_linear.wqkv.bias = arch.qkv_bias
        # torchtitan's block is the plain pre-norm residual block every family here is
        layers.append(Qwen3TransformerBlock.Config(
            attention_norm=norm(arch.dim), ffn_norm=norm(arch.dim), attention=attn,
            feed_forward=make_ffn_config(dim=arch.dim, hidden_dim=arch.ffn_dim, w1_param_init=normal,
                                         w2w3_param_init=normal)))
    return Qwen3Model.Config(
        vocab_size=arch.vocab_size, dim=arch.dim, norm=norm(arch.dim), enable_weight_tying=arch.tied,
        tok_embeddings=Embedding.Config(num_embeddings=arch.vocab_size, embedding_dim=arch.dim, param_init=normal),
        lm_head=Linear.Config(in_features=arch.dim, out_features=arch.vocab_size, param_init=normal),
        layers=layers)


def build(arch: Arch) -> torch.nn.Module:
    """The torchtitan model of `arch` on CPU, float32, randomly initialised (N(0, 0.02), norms 1)."""
    model = titan_config(arch).build()
    model.init_states(buffer_device=torch.device("cpu"))
    return model


# ---------------------------------------------------------------- HF names


_LAYER = {  # torchtitan name in block i -> HF name in layer i
    "attention.qkv_linear.wq": "self_attn.q_proj", "attention.qkv_linear.wk": "self_attn.k_proj",
    "attention.qkv_linear.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
    "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm",
    "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight"}
_TITAN_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")


class HFAdapter:
    """HF <-> torchtitan state-dict names for the dense decoder: a rename, rows untouched. A tied head is
    left out of `to_hf` (HF files may carry it or not) and taken from the embedding in `from_hf`."""

    def __init__(self, arch: Arch) -> None:
        self.arch = arch
        self._to_hf_layer = _LAYER
        self._from_hf_layer = {v: k for k, v in _LAYER.items()}
        self._from_hf_top = {v: k for k, v in _TOP.items()}

    def hf_name(self, name: str) -> str | None:
        """The HF name of torchtitan parameter `name` (the split wq/wk/wv, not wqkv), or None."""
        if name in _TOP:
            return None if (name == "lm_head.weight" and self.arch.tied) else _TOP[name]
        m = _TITAN_LAYER.fullmatch(name)
        if m and m.group(2) in self._to_hf_layer:
            return f"model.layers.{m.group(1)}.{self._to_hf_layer[m.group(2)]}.{m.group(3)}"
        return None

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for k, v in state_dict.items():
            hf = self.hf_name(k)
            if hf is not None:
                out[hf] = v
        return out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        """torchtitan names; a name this layout does not know is kept as it is, for the loader to
        report as unexpected; HF's stored rotary frequencies are dropped (RoPE is recomputed)."""
        out = {}
        for k, v in hf_state_dict.items():
            if k.endswith("rotary_emb.inv_freq"):
                continue
            m = _HF_LAYER.fullmatch(k)
            if k in self._from_hf_top:
                out[self._from_hf_top[k]] = v
            elif m and m.group(2) in self._from_hf_layer:
                out[f"layers.{m.group(1)}.{self._from_hf_layer[m.group(2)]}.{m.group(3)}"] = v
            else:
                out[k] = v
        if self.arch.tied:
            out["lm_head.weight"] = out.get("tok_embeddings.weight", out.get("lm_head.weight"))
        return out


# ---------------------------------------------------------------- layouts others rely on


def qkv_split(arch: Arch, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows of a fused QKV tensor (weight, bias or a LoRA B) as HF's q_proj / k_proj / v_proj rows: the
    fused rows are [KV group, hpk query heads + 1 key head + 1 value head, head_dim]."""
    hpk, hd = arch.n_heads // arch.n_kv_heads, arch.head_dim
    g = t.reshape(arch.n_kv_heads, hpk + 2, hd, *t.shape[1:])
    tail = t.shape[1:]
    return {"q_proj": g[:, :hpk].reshape(-1, *tail), "k_proj": g[:, hpk].reshape(-1, *tail),
            "v_proj": g[:, hpk + 1].reshape(-1, *tail)}


def qkv_row_runs(arch: Arch, a: int, n: int) -> list[tuple[str, int, int, int]]:
    """Rows [a, a + n) of a fused QKV tensor as runs of whole HF rows: (projection, first fused row,
    first row in the projection, rows). What a trainer rank's FSDP/TP shard of the fused weight (or bias)
    is in HF terms (pipeline/trainer/shards.py)."""
    hpk, hd = arch.n_heads // arch.n_kv_heads, arch.head_dim
    r = hpk + 2
    runs, row = [], a
    while row < a + n:
        g, j = divmod(row // hd, r)
        if j < hpk:  # the group's hpk query heads are hpk * hd consecutive q_proj rows
            proj, end, dst = "q_proj", (g * r + hpk) * hd, g * hpk * hd + row - g * r * hd
        else:
            proj, end, dst = ("k_proj" if j == hpk else "v_proj"), (g * r + j + 1) * hd, g * hd + row % hd
        m = min(end, a + n) - row
        runs.append((proj, row, dst, m))
        row += m
    return runs


LORA_MODULES = {"wqkv": ("self_attn", ("q_proj", "k_proj", "v_proj")), "wo": ("self_attn", ("o_proj",)),
                "w1": ("mlp", ("gate_proj",)), "w2": ("mlp", ("down_proj",)), "w3": ("mlp", ("up_proj",))}
"""LoRA target (pipeline.config LORA_TARGETS) -> the HF module and projections its adapter stands for."""

TP_PLAN = {"attention.qkv_linear.wqkv": "colwise", "attention.wo": "rowwise",
           "feed_forward.w1": "colwise", "feed_forward.w3": "colwise", "feed_forward.w2": "rowwise"}
"""Per block: the fused QKV (KV group by KV group, so a column shard is whole groups, bias included)
and the FFN's gate/up are column-sharded, the output projections row-sharded."""

TP_DIVIDES = ("num_key_value_heads", "intermediate_size", "vocab_size")


def tp_sizes(arch: Arch) -> dict[str, int]:
    """The sizes a tensor-parallel degree must divide, by HF name."""
    return {"num_key_value_heads": arch.n_kv_heads, "intermediate_size": arch.ffn_dim,
            "vocab_size": arch.vocab_size}


def per_head_params(arch: Arch) -> tuple[str, ...]:
    """Name parts of parameters that stay whole under tensor parallelism but act on each rank's heads
    alone (the q/k norms): their gradients are summed over the tp axis."""
    return (".q_norm.", ".k_norm.") if arch.qk_norm else ()



@dataclass(frozen=True)
class Family:
    """One model family: its config reader, and the build / names / layouts it uses (the dense decoder's
    unless the family says otherwise). The registry (pipeline/models/__init__.py) maps model_type to it."""

    model_type: str
    read: Any
    """(config.json dict, directory) -> Arch; raises ModelError naming the field."""
    summary: str
    """What the family covers, for the error of an unknown model_type."""
    build: Any = build
    adapter: Any = HFAdapter
    tp_plan: dict = field(default_factory=lambda: dict(TP_PLAN))
    lora_modules: dict = field(default_factory=lambda: dict(LORA_MODULES))
    qkv_split: Any = qkv_split
    qkv_row_runs: Any = qkv_row_runs
    per_head_params: Any = per_head_params
