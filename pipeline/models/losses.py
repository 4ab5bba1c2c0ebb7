"""A memory-lean KL loss for the draft (`train.loss_chunk_tokens`, issue #14): the same per-position
KL(target || draft) as speculators' eager `kl_div_loss`, computed over chunks of positions, keeping nothing
but its inputs for the backward.

speculators' eager loss keeps, for every TTT step, the fp32 log-softmax of the draft logits and the fp32
softmax of the target logits: 2 x [T, draft vocab] x 4 bytes per step (13.7 GiB of a Kimi-K2.5 draft's 55.6
GiB of activations at 8K packs and TTT 7, `eaglepipe plan`). This one keeps the draft logits as they are (bf16
under autocast) and a view of the target logits (computed once per forward), and recomputes both softmaxes per
chunk in the backward: d KL / d logits = softmax(logits) - softmax(targets), times the position's incoming
gradient. Plugged in through speculators' own loss config (`{"kl_div": (fn, weight)}`): its reduction, TTT
weighting and metrics are unchanged. tests/unit/test_losses.py holds loss and gradients to the eager ones.
"""

from __future__ import annotations

from functools import partial

import torch

from pipeline.lazy_compile import compile_deferred


class _ChunkedKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        rows_l, rows_t = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1, targets.shape[-1])
        out = torch.empty(rows_l.shape[0], dtype=torch.float32, device=logits.device)
        for a in range(0, rows_l.shape[0], chunk):
            log_q = torch.log_softmax(rows_l[a : a + chunk].float(), dim=-1)
            p = torch.softmax(rows_t[a : a + chunk].float(), dim=-1)
            out[a : a + chunk] = (torch.xlogy(p, p) - p * log_q).sum(-1)  # kl_div(log_q, p): 0 where p == 0
        ctx.save_for_backward(logits, targets)
        ctx.chunk = chunk
        return out.reshape(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, targets = ctx.saved_tensors
        rows_l, rows_t = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1, targets.shape[-1])
        g = grad_out.reshape(-1).float()
        grad = torch.empty_like(rows_l)
        for a in range(0, rows_l.shape[0], ctx.chunk):
            q = torch.softmax(rows_l[a : a + ctx.chunk].float(), dim=-1)
            p = torch.softmax(rows_t[a : a + ctx.chunk].float(), dim=-1)
            grad[a : a + ctx.chunk] = (g[a : a + ctx.chunk, None] * (q - p)).to(grad.dtype)
        return grad.reshape(logits.shape), None, None


def chunked_kl_div_loss(logits: torch.Tensor, targets: torch.Tensor, chunk: int = 2048) -> torch.Tensor:
    """Per-position KL(softmax(targets) || softmax(logits)), [1, seq_len], as speculators' eager kl_div_loss.
    The targets carry no gradient (the verifier's logits, computed under no_grad)."""
    if targets.requires_grad:
        raise ValueError("chunked_kl_div_loss: the targets must not require grad (the verifier's logits)")
    return _ChunkedKL.apply(logits, targets.detach(), chunk)


def loss_config(spec: str, chunk_tokens: int | None):
    """speculators' loss config for `train.loss`; with chunk_tokens, its `kl_div` term computed in chunks."""
    with compile_deferred():
        from speculators.losses.utils import resolve_loss_config

    config = resolve_loss_config(spec, "eager")
    if chunk_tokens and "kl_div" in config:
        config = {
            **config,
            "kl_div": (never_compiled(partial(chunked_kl_div_loss, chunk=chunk_tokens)), config["kl_div"][1]),
        }
    return config


def never_compiled(fn):
    """fn as a graph break where speculators compiles the draft's forward (CUDA): torch 2.11's dynamo fails an
    assertion tracing the chunked loss's autograd.Function (H200, 2026-12-02: every TTT-3 run of stage train
    stopped
    at its first step), so it runs eagerly inside the compiled forward, as speculators' own attention does.
    Without CUDA nothing is compiled and fn stays as it is: torch.compiler.disable imports dynamo, and with
    dynamo imported two gloo ranks of DDP on CPU hung in the process group's destructor at exit
    (tests/integration/
    test_ranks.py)."""
    return torch.compiler.disable(fn) if torch.cuda.is_available() else fn
