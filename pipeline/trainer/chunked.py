"""Log-probs and entropy of the sampled tokens without the [tokens, vocab] fp32 logits
(trainer.logprob_chunk_tokens).

The unchunked path, `model(ids)` then a float32 log-softmax over the whole vocabulary, holds
tokens × vocab × 4 bytes of logits, as much again for the log-softmax, and (for the entropy
bonus) the softmax, all saved for the backward: at Qwen's 151,936-token vocabulary one micro-batch
of 8 × 2,048 tokens is 10 GB per copy. Here the model runs up to its final norm as before, and
its output head is replaced, for that one call, by `ChunkedLogprobs`: it takes the final hidden
states h [N, D] and the head weight W [V, D] and walks over chunks of `chunk` tokens, computing
each chunk's logits z = (h_c W^T).float() / temperature (in the compute dtype, upcast per chunk,
as the unchunked path upcasts its logits), and keeps per token only log p(y) = log_softmax(z)_y and
the entropy H = −Σ p log p. The backward recomputes each chunk's logits and log-softmax and forms
the gradient of the logits there with the unchunked path's own autograd steps (mathematically
∂/∂z_k = g_logp · (1[k = y] − p_k) − g_H · p_k (log p_k + H), then / temperature), then
∂h_c = ∂z W and ∂W += ∂z^T h_c (accumulated in float32, cast to W's dtype at the end). Peak
memory of the loss is then a few chunk × vocab float32 buffers, whatever the token count; the
values and gradients equal the unchunked ones up to float rounding (tests/test_chunked_logprobs.py).

How it meets the model and its parallelisms: the head module is still *called* by the model's
forward (its `forward` is swapped for the call, `_head_swapped`), so whatever the model's wrappers
do around its forward stays: under FSDP2 the root's pre-forward hook has gathered the head weight
(in the compute dtype with mixed precision) before the head runs, the gradient reaches that
gathered weight and FSDP2 reduce-scatters it into the float32 shard as it does for F.linear; a head
tied to the embedding is the same parameter, so its gradient adds to the embedding's. LoRA adapts
the blocks' projections only, never the head. Tensor parallelism with an untied head shards the
head over the vocabulary (its weight is then a tp DTensor, parallel.py): that case keeps the
unchunked path (`chunkable` says no), since a vocab-parallel logsumexp is not implemented here.

Example:
    logp, ent = logprobs(model, ids, temperature, chunk=1024, entropy="grad")   # [B, T-1] each
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F


def _logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """One chunk's logits: the head in the compute dtype, then float32 / temperature (as the unchunked path)."""
    return F.linear(h, weight).float() / temperature


class ChunkedLogprobs(torch.autograd.Function):
    """(h [N, D], W [V, D], targets [N], temperature, chunk) -> (log p(target) [N], entropy [N]),
    both float32 and differentiable wrt h and W; saves only h, W (references) and the targets for
    the backward, which recomputes each chunk's logits and log-softmax."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = h.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=h.device)
        ent = torch.empty_like(logp)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            logz = F.log_softmax(_logits(h[s:e], weight, temperature), dim=-1)
            logp[s:e] = logz.gather(1, targets[s:e, None]).squeeze(1)
            ent[s:e] = -logz.exp().mul_(logz).sum(dim=-1)
            del logz
        ctx.save_for_backward(h, weight, targets)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None):
        # The unchunked path's autograd, op for op, on one chunk at a time: the gradient G of log p
        # (the gather's one-hot g_logp; the entropy's −g_H · (p log p + p)), then the log-softmax's
        # backward G − p · ΣG, the temperature's, and the head's matmuls.
        h, weight, targets = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_logp is None and g_ent is None) or not (need_h or need_w):
            return None, None, None, None, None
        t, n = ctx.temperature, h.shape[0]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for s in range(0, n, ctx.chunk):
            e = min(s + ctx.chunk, n)
            hc = h[s:e]
            logz = F.log_softmax(_logits(hc, weight, t), dim=-1)
            p = logz.exp()
            if g_ent is not None:
                gs = -g_ent[s:e, None]
                g = logz.mul_(gs).mul_(p).addcmul_(p, gs)
            else:
                g = logz.zero_()
            if g_logp is not None:
                g.scatter_add_(1, targets[s:e, None], g_logp[s:e, None].to(g.dtype))
            g = g.addcmul_(p, g.sum(dim=-1, keepdim=True), value=-1.0).div_(t).to(h.dtype)
            if need_h:
                grad_h[s:e] = g @ weight
            if need_w:
                grad_w += (g.t() @ hc).float()
            del logz, p, g
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None


def chunkable(model: torch.nn.Module) -> bool:
    """Whether the model's output head can be chunked: a bias-free Linear-like `lm_head` whose weight is
    not sharded over the vocabulary by tensor parallelism (a tp DTensor; an FSDP2 shard is gathered
    in the forward and is fine)."""
    from torch.distributed.tensor import DTensor

    head = getattr(model, "lm_head", None)
    w = getattr(head, "weight", None)
    if w is None or getattr(head, "bias", None) is not None or w.dim() != 2:
        return False
    if isinstance(w, DTensor):
        names = w.device_mesh.mesh_dim_names or ()
        return "tp" not in names
    return True


@contextmanager
def _head_swapped(head: torch.nn.Module, fn) -> Iterator[None]:
    """`head`'s forward is `fn` for the block (an instance attribute over the class's method), so the
    module is still called, with its hooks, by the model's own forward."""
    had = "forward" in head.__dict__
    old = head.__dict__.get("forward")
    head.forward = fn
    try:
        yield
    finally:
        if had:
            head.forward = old
        else:
            del head.forward


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    logz = torch.log_softmax(logits.float(), dim=-1)
    return -(logz.exp() * logz).sum(dim=-1)


def logprobs(model: torch.nn.Module, ids: torch.Tensor, temperature: float, chunk: int = 0,
             entropy: str = "", positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs [B, T-1] of ids[:, 1:] under softmax(logits / temperature), and the
    per-token entropy of that distribution: "" none (None), "value" detached, "grad" differentiable
    (the entropy bonus). chunk > 0: `ChunkedLogprobs` over chunks of that many tokens (the caller
    checks `chunkable`); 0: the full logits and their log-softmax (the unchunked path).

    `positions` (bool [B, T-1], chunked path only): the head runs on those tokens' hidden states
    alone and both outputs are 0 elsewhere; the values at `positions` and every gradient are those of
    the full computation (the blocks still run on every token: a causal model's later tokens see the
    earlier ones). The trainer passes its loss mask: the head (vocab x dim MACs a token, 21% of
    SmolLM2's forward) then skips the prompt and padding tokens. The unchunked path ignores it."""
    if chunk <= 0:
        logits = model(ids)[:, :-1].float() / temperature
        logp = torch.gather(F.log_softmax(logits, dim=-1), 2, ids[:, 1:, None]).squeeze(-1)
        if not entropy:
            return logp, None
        if entropy == "grad":
            return logp, _entropy(logits)
        with torch.no_grad():
            return logp, _entropy(logits)
    head = model.lm_head
    b, t = ids.shape
    targets = ids[:, 1:].reshape(-1)

    def head_forward(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from torch.distributed.tensor import DTensor

        if isinstance(head.weight, DTensor):  # chunkable() refuses a tp-sharded head; nothing else makes one here
            raise RuntimeError("chunked logprobs: the output head weight is a DTensor in the forward "
                               "(tensor parallel over the vocabulary); use trainer.logprob_chunk_tokens=0")
        x = h[:, :-1].reshape(-1, h.shape[-1])
        if sel is None:
            return ChunkedLogprobs.apply(x, head.weight, targets, float(temperature), int(chunk))
        lp, ent = ChunkedLogprobs.apply(x[sel], head.weight, targets[sel], float(temperature), int(chunk))
        zeros = lp.new_zeros(x.shape[0])
        return zeros.index_put((sel,), lp), zeros.index_put((sel,), ent)

    sel = None if positions is None else positions.reshape(-1).nonzero().squeeze(1).to(ids.device)
    with _head_swapped(head, head_forward):
        lp, ent = model(ids)
    lp, ent = lp.view(b, t - 1), ent.view(b, t - 1)
    if not entropy:
        return lp, None
    return lp, ent if entropy == "grad" else ent.detach()
