"""Teacher: on-policy distillation's scorer, a causal LM that gives the log-prob of every token the
student sampled, streamed beside generation (the reward model's machinery, pipeline/reward_model.py).

    t = TeacherScorer(hf_dir, temperature=0.7)
    t.prefill("g0r0/5", 0, teacher_prompt + first_chunk)    # a prefix cache per rollout, and the
    t.prefill("g0r0/5", 27, next_chunk)                      # log-probs of the chunk's tokens so far
    lps = t.finish("g0r0/5", 43, last_chunk)                # log π_T(x_i | x_<i) for i = 1 .. L-1
    lps == t.logprobs([whole_sequence])[0]                   # one-shot prefill: the same numbers

A stream is the teacher's prompt (the student's prompt, plus teacher.context's privileged text when
one is set) followed by the rollout's completion tokens (model turns and environment observations).
Each chunk is one forward on top of the stream's key/value cache; the log-prob of the chunk's first
token comes from the previous chunk's last hidden state, so the numbers do not depend on how the
sequence was chunked (attention is causal). Log-probs are of softmax(logits / temperature) in
float32, the distribution the student sampled from and the learner scores (generator.temperature).
The caller takes the completion's part (its tokens start after the teacher's prompt) and masks
environment tokens (pipeline/generator/scoring.py).

`check_tokenizers` is the start-up check that the teacher reads the student's token ids: the same
vocabulary, special ids and end-of-turn token; the first difference otherwise.

Pure torch + transformers, no Monarch: actors/teacher.py serves it on its own mesh.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from pipeline.reward_model import StreamingScorer, _Stream

__all__ = ["TeacherScorer", "check_tokenizers", "teacher_prompt"]


class TeacherScorer(StreamingScorer):
    """StreamingScorer whose result is the per-token log-probs of the stream (module docstring). A
    rollout's client sends the teacher's prompt alone first, so a group's samples share one prefill."""

    share_prefixes = True

    def __init__(self, hf_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 max_sequences: int = 4096, max_batch: int = 16, temperature: float = 1.0):
        from transformers import AutoConfig, AutoModelForCausalLM

        conf = AutoConfig.from_pretrained(hf_dir)
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, attn_implementation="sdpa")
        self._serve(hf_dir, conf, model, model.get_output_embeddings(), "output head (a decoder *ForCausalLM "
                    "model is needed)", device, max_sequences, max_batch)
        self.temperature = temperature if temperature > 0 else 1.0

    def _grown(self, st: _Stream | None, tokens: list[int], new: _Stream, hidden: torch.Tensor) -> _Stream:
        # position i's hidden state predicts token i + 1: the chunk's first token from the last one before it
        h = hidden[:-1] if st is None else torch.cat([st.last[None], hidden[:-1]])
        targets = tokens[1:] if st is None else tokens
        lps, top1 = ([], []) if st is None else st.extra
        if targets:
            logits = self.head(h).float() / self.temperature
            ids = torch.tensor(targets, device=h.device)
            lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, None])[:, 0]
            lps, top1 = lps + lp.tolist(), top1 + (logits.argmax(-1) == ids).int().tolist()
        new.extra = (lps, top1)
        return new

    def _final(self, st: _Stream) -> dict:
        """{"logprobs": log π_T(x_i | x_<i), "top1": 1 where x_i is the teacher's most likely token}, i = 1..L-1."""
        return {"logprobs": list(st.extra[0]), "top1": list(st.extra[1])}

    def logprobs(self, seqs: Sequence[Sequence[int]]) -> list[list[float]]:
        """Per-token log-probs of whole sequences (tokens 1..L-1), `max_batch` per padded forward."""
        return [r["logprobs"] for r in self.score(seqs)]


def one_shot_logprobs(hf_dir: str | Path, ids: Sequence[int], temperature: float = 1.0,
                      dtype: torch.dtype = torch.float32) -> list[float]:
    """HF transformers' log-probs of ids[1:] in one forward (the reference the streamed ones must equal)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([list(ids)])).logits[0, :-1].float() / temperature
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def check_tokenizers(student_dir: str | Path, teacher_dir: str | Path) -> str | None:
    """The first difference that keeps the teacher in `teacher_dir` from reading the student's token
    ids (vocabulary, special ids, end-of-turn token, vocab_size), or None if there is none."""

    from pipeline.tokens import SpecialTokens, load_tokenizer

    try:
        a = load_tokenizer(student_dir)
        b = load_tokenizer(teacher_dir)
    except Exception as e:  # noqa: BLE001 - the reason goes into the message
        return f"a tokenizer cannot be loaded ({type(e).__name__}: {str(e)[:200]})"
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        if len(va) != len(vb):
            return f"vocabularies differ in size: {len(va)} tokens (student) vs {len(vb)} (teacher)"
        tok = next(t for t in sorted(set(va) | set(vb), key=lambda t: va.get(t, vb.get(t, -1)))
                   if va.get(t) != vb.get(t))
        return f"token {tok!r} has id {va.get(tok)} (student) vs {vb.get(tok)} (teacher)"
    try:
        sa, sb = SpecialTokens.of(a), SpecialTokens.of(b)
    except Exception as e:  # noqa: BLE001
        return f"special tokens cannot be read ({type(e).__name__}: {str(e)[:200]})"
    for name in ("eos", "bos", "pad", "eot"):
        if name == "pad":
            continue  # a padding id is never scored
        if getattr(sa, name) != getattr(sb, name):
            what = {"eos": "end-of-sequence id", "bos": "beginning-of-sequence id", "eot": "end-of-turn id"}[name]
            return f"{what} {getattr(sa, name)} (student) vs {getattr(sb, name)} (teacher)"
    import json

    vocab = json.loads((Path(teacher_dir) / "config.json").read_text()).get("vocab_size", 0)
    if vocab < len(va):
        return f"the teacher's vocab_size {vocab} is smaller than the student tokenizer's {len(va)} tokens"
    return None


def teacher_prompt(prompt: Any, context: str) -> Any:
    """The teacher's prompt: `context` (already filled in) after the last user turn's text of a chat
    prompt, or before a plain prompt; the prompt itself when there is no context."""
    if not context:
        return prompt
    if isinstance(prompt, str):
        return f"{context}\n\n{prompt}"
    msgs = [dict(m) for m in prompt]
    last = max((i for i, m in enumerate(msgs) if m.get("role") == "user"), default=None)
    if last is None:
        return [*msgs, {"role": "user", "content": context}]
    msgs[last]["content"] = f"{msgs[last]['content']}\n\n{context}"
    return msgs
