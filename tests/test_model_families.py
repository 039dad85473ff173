"""Every registered model family computes HF transformers' function, and what this build cannot train is
refused before anything starts: random small llama (Llama 3.1 RoPE scaling, GQA, untied head), qwen2 (q/k/v
bias, tied) and qwen3 (q/k norm) checkpoints written by transformers itself; fp32 logits compared, bf16
norms bit for bit and bf16 log-probs; unknown model_type and unsupported fields raise ModelError naming the
directory, field and value; the CLI exits 2 with one line; a resume across a changed field is refused. Each
checkpoint is 2 layers, 64 wide (~2 s)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.config import Config, ConfigError, ModelConfig
from pipeline.models import ModelError, read_arch
from pipeline.models.hf import build_model, export_hf, load_hf_state_dict

REPO = Path(__file__).resolve().parents[1]
VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, hidden_act="silu")
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
FAMILIES = {
    # head_dim 16, theta 500000: with original_max_position_embeddings 32 the scaling divides some
    # frequencies, smooths some and keeps some, so all three branches of HF's llama3 formula run
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(tie_word_embeddings=False, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True, rope_theta=1e6, head_dim=32)),
}


def write_checkpoint(out: Path, family: str, seed: int = 0, **edits) -> Path:
    """A random `family` checkpoint saved by transformers (config.json + model.safetensors), every
    parameter random (biases and norm weights too, so each one shows in the logits), plus the tiny
    tokenizer files so the directory passes model_dir's check."""
    import transformers

    conf_cls, model_cls, extra = FAMILIES[family]
    conf = getattr(transformers, conf_cls)(**{**BASE, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(conf).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.08)
    model.save_pretrained(out)
    if edits:
        path = out / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **edits}, indent=2))
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: write_checkpoint(root / f, f) for f in FAMILIES}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_trainer_logits_equal_hf_transformers_fp32(checkpoints, family):
    from transformers import AutoModelForCausalLM

    d = checkpoints[family]
    arch = read_arch(d)
    assert arch.model_type == family
    assert (arch.qkv_bias, arch.qk_norm, arch.tied) == (family == "qwen2", family == "qwen3", family != "llama")
    model, adapter = build_model(d)
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, ref = model(ids).float(), hf(ids).logits.float()
    assert ref.std() > 0.1  # random weights of this scale give logits far from uniform
    assert (ours - ref).abs().max().item() <= 2e-4
    src, out = load_hf_state_dict(d), export_hf(model, adapter)
    for k, v in out.items():  # HF names and HF row order out: bit for bit what was loaded
        assert torch.equal(v, src[k]), k
    assert set(src) - set(out) <= {"lm_head.weight"}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_trainer_norms_round_as_hf_transformers_in_bf16(checkpoints, family):
    """In bf16 each RMSNorm (the q/k norms too) rounds the float32-normalised input to bf16, then multiplies
    by the bf16 weight, as HF and vLLM do (pipeline/models/norm.py): bit for bit HF's output. torch's
    F.rms_norm rounds once, after the weight: one bf16 step apart on ~1/4 of the outputs, a mean
    |Δ log p| of ~5e-3 on these checkpoints. The whole bf16 model then gives HF's log-probs."""
    from torchtitan.models.common.nn_modules import RMSNorm
    from transformers import AutoModelForCausalLM

    d = checkpoints[family]
    model, adapter = build_model(d, dtype=torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.bfloat16)
    hf_modules = dict(hf.named_modules())
    gen = torch.Generator().manual_seed(2)
    norms = [(n, m) for n, m in model.named_modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * 2 + 1 + (2 * 2 if family == "qwen3" else 0)
    with torch.no_grad():
        for name, norm in norms:
            x = (3 * torch.randn(2, 40, norm.weight.shape[0], generator=gen)).bfloat16()
            ref = hf_modules[adapter.hf_name(f"{name}.weight").removesuffix(".weight")]
            assert torch.equal(norm(x), ref(x)), name
        ids = torch.randint(0, VOCAB, (2, 40), generator=gen)
        ours = torch.log_softmax(model(ids).float(), -1)
        ref = torch.log_softmax(hf(ids).logits.float(), -1)
    assert (ours - ref).abs().mean().item() <= 5e-4  # 0 on this machine's kernels


def test_llama3_rope_scaling_is_read_and_changes_the_function(checkpoints, tmp_path):
    arch = read_arch(checkpoints["llama"])
    assert arch.llama3_rope == {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 32}
    plain = shutil.copytree(checkpoints["llama"], tmp_path / "plain")
    conf = json.loads((plain / "config.json").read_text())
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(conf.get(key), dict):
            conf[key] = {"rope_type": "default", "rope_theta": 500000.0}
    (plain / "config.json").write_text(json.dumps(conf))
    ids = torch.arange(40)[None] % VOCAB
    with torch.no_grad():
        a, b = build_model(checkpoints["llama"])[0](ids), build_model(plain)[0](ids)
    assert (a - b).abs().max() > 1e-3


def test_rope_frequencies_stay_float32_and_rotate_in_the_query_dtype(checkpoints):
    """What vLLM and HF do: angles in float32, cos/sin cast to the query's dtype, no per-layer table."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model, _ = build_model(checkpoints["llama"], dtype=torch.bfloat16)
    ropes = [layer.attention.rope for layer in model.layers.values()]
    assert all(r.inv_freq.dtype == torch.float32 for r in ropes)
    assert sum(b.numel() for b in model.buffers()) <= len(ropes) * 16  # head_dim / 2 per layer, no table
    q, k = torch.randn(2, 40, 4, 16).bfloat16(), torch.randn(2, 40, 2, 16).bfloat16()
    pos = torch.arange(40)[None]
    angles = pos.float()[..., None] * ropes[0].inv_freq
    emb = torch.cat((angles, angles), -1)
    want = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), emb.cos().bfloat16(), emb.sin().bfloat16())
    got = ropes[0](q, k, pos)
    assert torch.equal(got[0], want[0].transpose(1, 2)) and torch.equal(got[1], want[1].transpose(1, 2))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_shards_of_the_fused_qkv_reassemble_the_hf_tensors(checkpoints, family):
    """Uneven row blocks of the fused QKV weight and bias (as FSDP2 and tensor-parallel shards cut it) map
    to boxes of HF q/k/v that rebuild the checkpoint's own tensors: what a sharded push sends, in HF order."""
    from pipeline.trainer.shards import _qkv_runs

    d = checkpoints[family]
    model, adapter = build_model(d)
    src = load_hf_state_dict(d)
    params = ["weight"] + (["bias"] if family == "qwen2" else [])
    for i in range(2):
        for param in params:
            name = f"layers.{i}.attention.qkv_linear.wqkv.{param}"
            full = model.get_parameter(name).detach()
            n = full.shape[0]
            got = {f"model.layers.{i}.self_attn.{p}_proj.{param}": None for p in "qkv"}
            got = {k: torch.full_like(src[k], float("nan")) for k in got}
            for a, b in zip([0, 5, n // 3, n // 2 + 3], [5, n // 3, n // 2 + 3, n]):
                for (hf, start, size), t in _qkv_runs(model, adapter, name, (a, *[0] * (full.dim() - 1)),
                                                       (b - a, *full.shape[1:]), full[a:b]):
                    got[hf][tuple(slice(s0, s0 + z) for s0, z in zip(start, size))] = t
            assert all(torch.equal(got[k], src[k]) for k in got), (family, name)


REFUSED = [  # (family, config.json edit, the field the error names)
    ("llama", {"model_type": "gemma2"}, "model_type"),
    ("llama", {"hidden_act": "gelu_pytorch_tanh"}, "hidden_act"),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": None}, "rope_scaling"),
    ("llama", {"attention_bias": True}, "attention_bias"),
    ("llama", {"mlp_bias": True}, "mlp_bias"),
    ("llama", {"sliding_window": 4096}, "sliding_window"),
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen3", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}, "rope_parameters": None}, "rope_scaling"),
    ("qwen3", {"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
]


@pytest.mark.parametrize("family,edit,field", REFUSED, ids=[f"{f}-{k}" for f, _, k in REFUSED])
def test_an_unsupported_field_is_a_model_error_naming_dir_field_and_value(checkpoints, tmp_path, family, edit, field):
    d = shutil.copytree(checkpoints[family], tmp_path / "ckpt")
    conf = {**json.loads((d / "config.json").read_text()), **edit}
    (d / "config.json").write_text(json.dumps({k: v for k, v in conf.items() if v is not None}))
    with pytest.raises(ModelError) as e:
        read_arch(d)
    msg = str(e.value)
    assert str(d) in msg and f"{field}=" in msg and "supported" in msg and "\n" not in msg, msg
    with pytest.raises(ModelError):
        build_model(d)


def test_resume_refuses_a_checkpoint_whose_norm_epsilon_differs(checkpoints, tmp_path):
    from pipeline.checkpoint import check_fingerprint, fingerprint

    d = shutil.copytree(checkpoints["qwen2"], tmp_path / "q2")
    saved = fingerprint(Config(model=ModelConfig(hf_dir=str(d))))
    assert saved["model.rms_norm_eps"] == 1e-5 and saved["model.attention_bias"] is True
    conf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**conf, "rms_norm_eps": 1e-6}))
    with pytest.raises(ConfigError, match="rms_norm_eps"):
        check_fingerprint(saved, Config(model=ModelConfig(hf_dir=str(d))), tmp_path / "step_1")


def test_cli_exits_2_with_one_line_for_an_unsupported_checkpoint(checkpoints, tiny_dir, tmp_path):
    d = shutil.copytree(checkpoints["llama"], tmp_path / "ckpt")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / f, d / f)
    conf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**conf, "hidden_act": "gelu"}))
    p = subprocess.run([sys.executable, "-m", "pipeline.run", "--config", str(REPO / "configs" / "tiny.yaml"),
                        f"model.hf_dir={d}", f"run.out_dir={tmp_path / 'out'}"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-3000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "hidden_act='gelu'" in lines[0] and str(d) in lines[0], p.stderr[-3000:]
