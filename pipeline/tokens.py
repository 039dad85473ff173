"""The checkpoint's tokenizer side: its special ids, a prompt's tokens, a chat rollout's observation turns.

    tok = load_tokenizer(hf_dir)                          # HF fast tokenizer (the files vLLM reads)
    special = SpecialTokens.of(tok)                       # eos, pad, bos and the stop set, from the files
    ids = encode_prompt(tok, prompt, enable_thinking)     # a str raw; messages through the chat template
    ids = encode_completion(tok, "cba") + [special.end_of_turn(prompt)]   # a demonstrated model turn
    frame = observation_frame(tok, prompt, enable_thinking)   # multi-turn: what wraps an observation

Special ids are the checkpoint's, never constants: `SpecialTokens.of` reads them once from the
tokenizer (tokenizer_config.json / tokenizer.json), its chat template and the checkpoint's
generation_config.json. `eos` is the tokenizer's end-of-sequence token; `eot` the chat template's end
of turn: the special token that closes an assistant turn in the template's own rendering (ChatML's
`<|im_end|>`, Llama 3's `<|eot_id|>` where eos is `<|end_of_text|>`), eos for a tokenizer without a
template or one whose turns end in plain text. `end_of_turn(prompt)` is what ends a model turn: `eot`
after a chat prompt, `eos` after a str prompt (plain text has no turns). `stop` is every id that ends
a turn (eos, eot and every eos id of generation_config.json: Qwen3 stops at 151645 and 151643); `pad`
fills batches (the tokenizer's pad, else generation_config's, else eos).

A prompt is a str or a list of messages ({"role": ..., "content": ...}). `encode_prompt` is the one
place either becomes tokens, for every path (the generators, whose ids the trainer gets back in each
Rollout; the warm start; evaluation; the reward model's inputs): a str as it is, with the tokenizer's
own special tokens (a BOS for a Llama-style tokenizer, nothing for the tiny and Qwen tokenizers);
messages rendered once by the tokenizer's chat template with the generation prompt, passing
`enable_thinking` (task.enable_thinking) only when it is set. A bad prompt raises PromptError naming
what is wrong: not a str or a list, a message without a str role or content, messages for a
tokenizer with no chat template (naming its checkpoint directory).

A chat rollout's observation becomes a user turn of the template (pipeline/generator/envs.py):
`observation_frame` cuts the template's own rendering of [user, assistant, user] at two markers into
the tokens before and after an observation; a str prompt's frame is empty (the observation's tokens
alone, as before chat prompts existed).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.types import Prompt

__all__ = ["PromptError", "SpecialTokens", "ObservationFrame", "load_tokenizer", "check_messages",
           "encode_prompt", "encode_completion", "observation_frame"]


class PromptError(ValueError):
    """A prompt that cannot become tokens, with what is wrong."""


def load_tokenizer(hf_dir: str | Path):
    """HF fast tokenizer of the checkpoint (the same files vLLM reads); its name_or_path is `hf_dir`."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf_dir))


def _ids(value: Any) -> list[int]:
    """generation_config's eos_token_id: an int, a list of ints, or absent."""
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):  # a checkpoint without it
        return {}


@dataclass(frozen=True)
class SpecialTokens:
    """The checkpoint's special ids (module docstring); `bos` is None for a tokenizer without one."""

    eos: int
    pad: int
    bos: int | None
    stop: tuple[int, ...]
    eot: int

    def end_of_turn(self, prompt: Prompt) -> int:
        """The id that ends a model turn after `prompt`: the template's end of turn after messages,
        eos after a str."""
        return self.eos if isinstance(prompt, str) else self.eot

    @classmethod
    def of(cls, tok) -> "SpecialTokens":
        """Read from `tok` and the generation_config.json / config.json of its directory."""
        d = Path(tok.name_or_path or "")
        gen, conf = ({}, {}) if not tok.name_or_path else (_read_json(d / "generation_config.json"),
                                                           _read_json(d / "config.json"))
        gen_eos = _ids(gen.get("eos_token_id"))
        eos = next((i for i in [tok.eos_token_id, *gen_eos, *_ids(conf.get("eos_token_id"))] if i is not None), None)
        if eos is None:
            raise PromptError(f"{d}: no end-of-sequence token (eos_token in tokenizer_config.json, eos_token_id "
                              "in generation_config.json or config.json); a model turn could never end")
        pad = next(i for i in (tok.pad_token_id, gen.get("pad_token_id"), conf.get("pad_token_id"), eos)
                   if i is not None)
        eot = _template_end_of_turn(tok, int(eos))
        return cls(eos=int(eos), pad=int(pad), bos=tok.bos_token_id,
                   stop=tuple(dict.fromkeys([int(eos), eot, *gen_eos])), eot=eot)


def _template_end_of_turn(tok, eos: int) -> int:
    """The special token that closes an assistant turn in the chat template's rendering of [user,
    assistant, user] (what follows the assistant's content, whitespace before it skipped); `eos`
    without a template, or when the turn ends in plain text or the template cannot render that
    conversation (then chat prompts fail where they are encoded, naming the template)."""
    if not getattr(tok, "chat_template", None):
        return eos
    try:
        head = _chat_frame(tok, None).head
    except PromptError:
        return eos
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    for i in head:
        if i in special:
            return int(i)
        if tok.decode([i]).strip():  # text before any special token: the template ends turns in text
            return eos
    return eos


def check_messages(prompt: Any) -> list[dict]:
    """`prompt` if it is a non-empty list of messages with str role and content; PromptError naming
    the first thing wrong otherwise."""
    if not isinstance(prompt, (list, tuple)):
        raise PromptError(f"a prompt is a str or a list of messages, got {type(prompt).__name__}")
    if not prompt:
        raise PromptError("the prompt is an empty list of messages")
    for i, m in enumerate(prompt):
        if not isinstance(m, dict):
            raise PromptError(f"message {i} is a {type(m).__name__}, not an object with 'role' and 'content'")
        for key in ("role", "content"):
            if key not in m:
                raise PromptError(f"message {i} has no {key!r} (a message is {{'role': ..., 'content': ...}})")
            if not isinstance(m[key], str):
                raise PromptError(f"message {i}: {key!r} must be a string, got {type(m[key]).__name__}")
        if not m["role"]:
            raise PromptError(f"message {i}: 'role' is empty")
    return list(prompt)


def _render(tok, messages: list[dict], generation_prompt: bool, enable_thinking: bool | None) -> str:
    if not getattr(tok, "chat_template", None):
        raise PromptError(f"the prompt is a list of messages, but the tokenizer of {tok.name_or_path} has no chat "
                          "template (chat_template in tokenizer_config.json): give str prompts, or use a chat "
                          "checkpoint")
    kw = {} if enable_thinking is None else {"enable_thinking": enable_thinking}  # else the template's default
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kw)
    except Exception as e:  # jinja's TemplateError and the template's own raise_exception
        raise PromptError(f"the chat template of {tok.name_or_path} refused the messages: "
                          f"{type(e).__name__}: {e}") from e


def encode_prompt(tok, prompt: Prompt, enable_thinking: bool | None = None) -> list[int]:
    """A prompt's token ids, the one way every path makes them (module docstring)."""
    if isinstance(prompt, str):
        return list(tok(prompt, add_special_tokens=True)["input_ids"])
    text = _render(tok, check_messages(prompt), True, enable_thinking)
    return list(tok(text, add_special_tokens=False)["input_ids"])  # the template wrote every special token


def encode_completion(tok, text: str) -> list[int]:
    """A completion's token ids (a demonstration, an observation), which continue a prompt: no special tokens."""
    return list(tok(text, add_special_tokens=False)["input_ids"])


@dataclass(frozen=True)
class ObservationFrame:
    """What wraps an observation's tokens in a multi-turn rollout: `head` before them, `tail` after.
    For a chat prompt `head` closes the model's turn and opens a user turn, `tail` closes it and
    opens the model's next turn (Qwen3: `<|im_end|>\\n<|im_start|>user\\n`, `<|im_end|>\\n<|im_start|>assistant\\n`);
    for a str prompt both are empty."""

    head: tuple[int, ...] = ()
    tail: tuple[int, ...] = ()

    def head_after(self, last: int | None) -> tuple[int, ...]:
        """The head after a model turn whose last token is `last`: its first token is left out when
        the model already wrote it (its end of turn), so the layout is the template's whether the
        turn stopped there or was cut by its length budget."""
        return self.head[1:] if self.head and last == self.head[0] else self.head

    def wrap(self, obs: list[int], last: int | None) -> list[int]:
        """The observation turn's tokens after a model turn whose last token is `last`."""
        return [*self.head_after(last), *obs, *self.tail]


_TURN, _OBS = "\x00turn\x00", "\x00obs\x00"  # markers no template changes and no text contains


def observation_frame(tok, prompt: Prompt, enable_thinking: bool | None = None) -> ObservationFrame:
    """The frame of an observation after a model turn of a rollout of `prompt` (ObservationFrame):
    empty for a str prompt, the chat template's user turn for messages (made once per tokenizer)."""
    return ObservationFrame() if isinstance(prompt, str) else _chat_frame(tok, enable_thinking)


@functools.lru_cache(maxsize=8)
def _chat_frame(tok, enable_thinking: bool | None) -> ObservationFrame:
    """Rendering [user, assistant, user] whole, rather than a lone user turn, keeps what the template
    writes between turns and leaves out what it writes only at the start (a default system prompt)."""
    text = _render(tok, [{"role": "user", "content": "q"}, {"role": "assistant", "content": _TURN},
                         {"role": "user", "content": _OBS}], True, enable_thinking)
    after = text.split(_TURN, 1)[-1].split(_OBS)
    if _TURN not in text or len(after) != 2:
        raise PromptError(f"the chat template of {tok.name_or_path} does not show a message's content as "
                          "given; an observation turn cannot be framed with it")
    return ObservationFrame(tuple(encode_completion(tok, after[0])), tuple(encode_completion(tok, after[1])))
