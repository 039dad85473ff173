"""Qwen3 assets built offline (pipeline/models/qwen3_tokenizer.py, pipeline/models/qwen3_checkpoint.py): the tokenizer is Qwen's (ids,
specials, chat template, stop ids), the checkpoint has Qwen3-0.6B's config and layout, and HF transformers
and this project's trainer both load a shrunk one and agree on its logits.

    .venv/bin/python -m pytest -q tests/test_qwen3.py

The tokenizer and the shrunk checkpoint are built once under .cache/qwen3 and reused by later sessions.
"""

from __future__ import annotations

import ast
import base64
import json
import unicodedata
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pipeline.models.hf import build_model
from pipeline.models.qwen3_tokenizer import (
    ADDED_TOKENS, BPE_RANKS, ENDOFTEXT_ID, IM_END_ID, IM_START_ID, PATTERN, TOKEN_IDS, ensure_tokenizer, vocab_file,
)
from pipeline.models.qwen3_checkpoint import (
    QWEN3_0_6B, VOCAB_SIZE, build_checkpoint, ensure_checkpoint, qwen3_config, tensor_shapes,
)

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache" / "qwen3"
SMALL = dict(layers=2, hidden=64, ffn=128, heads=2, kv_heads=1)
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\n4"},
    {"role": "user", "content": "And 3+3?"},
]
RENDERED = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
            "<|im_start|>assistant\n4<|im_end|>\n"  # reasoning before the last query is dropped
            "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
            "<|im_start|>assistant\n")


@pytest.fixture(scope="session")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ensure_tokenizer(CACHE)))


@pytest.fixture(scope="session")
def small_dir() -> Path:
    return ensure_checkpoint(qwen3_config(**SMALL), seed=0, cache_dir=CACHE)


def test_known_tokenizations_and_special_ids(tok):
    assert tok("\n")["input_ids"] == [198]
    assert tok(" the")["input_ids"] == [279]
    assert tok("Hello world")["input_ids"] == [9707, 1879]
    assert tok("<|im_end|>")["input_ids"] == [IM_END_ID] == [151645]
    assert (ENDOFTEXT_ID, IM_START_ID) == (151643, 151644)
    assert len(tok) == BPE_RANKS + len(ADDED_TOKENS) == 151669
    assert {c: tok.convert_tokens_to_ids(c) for c, _ in ADDED_TOKENS} == TOKEN_IDS
    assert TOKEN_IDS["<|vision_pad|>"] == 151654 and TOKEN_IDS["<tool_call>"] == 151657
    assert TOKEN_IDS["<think>"] == 151667 and TOKEN_IDS["</think>"] == 151668
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id, tok.bos_token) == ("<|im_end|>", 151645, 151643, None)
    # Qwen3 flags the think and tool markers non-special: decoding keeps them, drops <|im_end|>.
    assert tok.decode([151667, 19, 151645], skip_special_tokens=True) == "<think>4"


def test_tokenizer_equals_tiktoken_on_qwens_own_ranks(tok):
    """The conversion (merges recovered from ranks, NFC, the split regex) tokenizes as tiktoken does."""
    import tiktoken

    lines = vocab_file().read_bytes().splitlines()
    ranks = {base64.b64decode(a): int(b) for a, b in (line.split() for line in lines if line)}
    enc = tiktoken.Encoding("qwen", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens=TOKEN_IDS)
    text = unicodedata.normalize("NFC", (REPO / "pipeline" / "losses.py").read_text() + (
        " Ünïcödé 日本語のテキスト 中文 12345678 \t\t  x  \r\n\r\n 🎉👍🏽 ∑∫ ﬁ café 'll I'M don't  \n\n\n"))
    assert tok(text, add_special_tokens=False)["input_ids"] == enc.encode(text, disallowed_special=())


def test_the_split_regex_and_first_special_id_are_dashscopes():
    """PATTERN and BPE_RANKS are Qwen's: the same as dashscope's Qwen tokenizer (read, not imported)."""
    src = ast.parse((vocab_file().parents[1] / "tokenizers" / "qwen_tokenizer.py").read_text())
    consts = {t.id: n.value.value for n in src.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
              for t in n.targets if isinstance(t, ast.Name)}
    assert consts["PAT_STR"] == PATTERN and consts["SPECIAL_START_ID"] == BPE_RANKS


def test_chat_template_two_turns_with_and_without_thinking(tok):
    no_think = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert no_think == RENDERED + "<think>\n\n</think>\n\n"
    assert tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == RENDERED
    ids = tok(no_think, add_special_tokens=False)["input_ids"]
    assert ids[:3] == [151644, 8948, 198] and ids[-5:] == [198, 151667, 271, 151668, 271]
    assert ids.count(IM_START_ID) == 5 and ids.count(IM_END_ID) == 4


def test_chat_template_renders_tools_calls_and_responses(tok):
    params = {"type": "object", "properties": {"city": {"type": "string"}}}
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": params}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny"},
    ]
    out = tok.apply_chat_template(messages, tools=[tool], tokenize=False, add_generation_prompt=True)
    assert out == (
        "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(tool, ensure_ascii=False) +
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
        "<args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


def test_generation_config_stops_on_end_of_turn_and_end_of_text(small_dir):
    from transformers import GenerationConfig

    gen = GenerationConfig.from_pretrained(str(small_dir))
    assert gen.eos_token_id == [151645, 151643] and gen.pad_token_id == 151643 and gen.bos_token_id == 151643


def test_full_config_is_qwen3_0_6b():
    conf = qwen3_config()
    assert conf == QWEN3_0_6B
    assert (conf["num_hidden_layers"], conf["hidden_size"], conf["num_attention_heads"], conf["num_key_value_heads"],
            conf["head_dim"], conf["intermediate_size"], conf["vocab_size"]) == (28, 1024, 16, 8, 128, 3072, 151936)
    assert conf["tie_word_embeddings"] and conf["rope_theta"] == 1e6 and conf["rms_norm_eps"] == 1e-6
    assert conf["max_position_embeddings"] == 40960 and conf["torch_dtype"] == "bfloat16"
    shapes = tensor_shapes(conf)
    stored = sum(torch.Size(s).numel() for s in shapes.values())
    assert len(shapes) == 311  # as in Qwen3-0.6B's model.safetensors, lm_head included
    assert stored - VOCAB_SIZE * 1024 == 596_049_920  # the 0.6B parameters: the embedding counted once
    with pytest.raises(ValueError, match="num_key_value_heads"):
        qwen3_config(heads=3, kv_heads=2)


def test_shrunk_checkpoint_keeps_vocab_head_dim_and_tying(small_dir):
    conf = json.loads((small_dir / "config.json").read_text())
    assert conf == {**QWEN3_0_6B, "num_hidden_layers": 2, "max_window_layers": 2, "hidden_size": 64,
                    "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}
    with safe_open(str(small_dir / "model.safetensors"), "pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}
    assert {k: tuple(v.shape) for k, v in sd.items()} == tensor_shapes(conf)
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (2 * 128, 64)
    assert all(v.dtype == torch.bfloat16 for v in sd.values())
    assert torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])
    assert all(torch.all(v == 1) for k, v in sd.items() if k.endswith("norm.weight"))
    assert sd["model.embed_tokens.weight"].float().std().item() == pytest.approx(0.02, rel=0.02)
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "generation_config.json"):
        assert (small_dir / f).is_file(), f


def test_hf_transformers_loads_it_tied_and_runs_a_forward(small_dir, tok):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(small_dir))
    assert model.dtype == torch.bfloat16 and model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.tensor([tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], VOCAB_SIZE) and torch.isfinite(logits).all()


def test_trainer_model_loads_it_and_matches_hf_logits(small_dir, tok):
    """The project's torchtitan build (pipeline/models/hf.py) reads the same folder and computes HF's logits."""
    from transformers import AutoModelForCausalLM

    model, _ = build_model(small_dir)
    assert model.lm_head.weight is model.tok_embeddings.weight
    hf = AutoModelForCausalLM.from_pretrained(str(small_dir), dtype=torch.float32)
    ids = torch.tensor([tok(RENDERED, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_builds_are_cached_and_deterministic(tmp_path, small_dir):
    assert ensure_checkpoint(qwen3_config(**SMALL), seed=0, cache_dir=CACHE) == small_dir
    assert ensure_tokenizer(CACHE) == ensure_tokenizer(CACHE)
    fresh = build_checkpoint(tmp_path / "q3", qwen3_config(**SMALL), seed=0, cache_dir=CACHE)
    for f in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (fresh / f).read_bytes() == (small_dir / f).read_bytes(), f
