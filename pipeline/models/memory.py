"""Training memory of the EAGLE-3 draft per GPU, computed (issue #15 item 3), and a counter to check it
against.

`estimate(...)` adds up, per rank: parameters (fp32 master weights, as accelerate's bf16 mixed precision keeps
them), gradients and AdamW's two moments of the trainable part; DDP's gradient buckets (a second copy of the
gradients: accelerate's DDP default, gradient_as_bucket_view=False) or, under FSDP (full shard), 1/N of all of
it plus the largest unit gathered unsharded; the batch; and the activations autograd keeps for the backward of
every TTT step of speculators' Eagle3DraftModel with a Llama layer (sdpa, dense masks), term by term. The
terms
are what `LiveTensors` shows alive after the forward of the real draft on CPU (fp32, and bf16 autocast: the
GPU's setting), and `tests/unit/test_memory.py` holds the two within a few percent at two shapes.

`LiveTensors` is a TorchDispatchMode that counts the bytes of every storage created under it while it lives
(a storage is freed when its last tensor is): a CPU stand-in for torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

GIB = 2**30


@dataclass(frozen=True)
class DraftShape:
    tokens: int  # per pack (train.tokens_per_pack)
    ttt_steps: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    draft_vocab: int
    n_aux: int = 3


@dataclass(frozen=True)
class DraftParams:
    trainable: int  # fc, the decoder layer, the final norm
    frozen: int  # target embedding, lm_head, verifier lm_head and norm (speculators freezes them)
    largest_unit: int  # FSDP: the most parameters gathered at once (the embedding, or the decoder layer)
    linear_trainable: int  # trainable weights that go through a matmul (autocast keeps a bf16 copy of each)
    largest_trainable_unit: int = 0  # FSDP: the most gradients held unsharded at once (the decoder layer)


def activation_terms(s: DraftShape, bf16: bool, loss_chunk: int | None = None) -> dict[str, float]:
    """Bytes autograd keeps after the forward, by term. bf16=True: under bf16 autocast (the GPU default),
    where
    matmul inputs/outputs are bf16 and the residual stream, norms and softmaxes stay fp32; False: fp32 (CPU).
    loss_chunk: train.loss_chunk_tokens (pipeline/models/losses.py) keeps the logits, not two fp32
    softmaxes."""
    T, H, Im, k = s.tokens, s.hidden, s.intermediate, s.ttt_steps  # Im: the MLP width
    q = s.heads * s.head_dim
    c = 2 if bf16 else 4  # matmul-side dtype
    kv_len = T * k * (k + 1) // 2  # sum over steps of the keys each step attends to (j x T at step j)
    terms = {
        # every TTT step j = 1..k
        "mlp (gate, up, silu, product) [T, I]": 4 * T * Im * c * k,
        "attention q, output [T, heads x head_dim]": 2 * T * q * c * k,
        "attention K, V repeated to all heads [j T, heads x head_dim]": 2 * kv_len * q * c,
        "attention mask [T, j T] (dense, sdpa)": T * kv_len * c,
        **(
            {"draft/target log-probs [T, draft vocab] fp32": 2 * T * s.draft_vocab * 4 * k}
            if not loss_chunk
            else {
                "draft logits [T, draft vocab] (chunked KL)": T * s.draft_vocab * c * k,
                "target logits [T, draft vocab], once (chunked KL)": T * s.draft_vocab * c,
            }
        ),
        "rope cos/sin [T, head_dim] fp32 (2 per step)": 2 * T * s.head_dim * 4 * k,
    }
    if bf16:
        terms["residual stream, norms, halves [T, H] fp32 (8 per step)"] = 8 * T * H * 4 * k
        terms["bf16 casts of layer inputs [T, 2H] x3 + [T, H] x2"] = 8 * T * H * c * k
        terms["lm_head weight cast per step (frozen: not cached)"] = s.draft_vocab * H * c * k
        terms["fc input cast [T, n_aux H]"] = T * s.n_aux * H * c
    else:
        terms["residual stream, norms, concatenations [T, H] (11 per step)"] = 11 * T * H * 4 * k
    return terms


def dense_target_params(layers: int, s: DraftShape, vocab: int) -> int:
    """A dense decoder's parameters from its layer shape (untied embeddings and lm_head, RMSNorm): what a
    target
    that declares no `num_parameters` is taken to hold; an upper bound for a target that ties them (SmolLM2).
    A MoE target must declare its own (all experts)."""
    attn = s.hidden * s.heads * s.head_dim * 2 + s.hidden * s.kv_heads * s.head_dim * 2
    return 2 * vocab * s.hidden + layers * (attn + 3 * s.hidden * s.intermediate + 2 * s.hidden) + s.hidden


def estimate(
    s: DraftShape,
    p: DraftParams,
    world_size: int = 1,
    strategy: str = "ddp",
    bf16: bool = True,
    loss_chunk: int | None = None,
    beside: dict[str, float] | None = None,
) -> dict:
    """Per-rank bytes by part, and the peak (everything at once: the forward's activations, then the
    gradients written while they are released, so their sum bounds the backward). `beside`: what else the
    training process holds on the GPU for the whole run (the target's weights: online features, the tau
    probe)."""
    if strategy not in ("ddp", "fsdp"):
        raise ValueError(f"strategy {strategy!r}: ddp or fsdp")
    shard = world_size if strategy == "fsdp" else 1
    parts = {
        "frozen parameters (fp32)": 4 * p.frozen / shard,
        "trainable parameters (fp32)": 4 * p.trainable / shard,
        "gradients (fp32)": 4 * p.trainable / shard,
        "AdamW moments (fp32 x 2)": 8 * p.trainable / shard,
    }
    if strategy == "ddp" and world_size > 1:
        parts["DDP gradient buckets (fp32)"] = 4 * p.trainable
    if strategy == "fsdp" and world_size > 1:
        parts["FSDP largest unit gathered + its unsharded gradients (fp32)"] = (
            4 * p.largest_unit + 4 * p.largest_trainable_unit
        )
    if bf16:
        parts["autocast bf16 copies of trainable weights"] = 2 * p.linear_trainable
    parts["batch (hidden states bf16 + ids, masks)"] = s.tokens * ((s.n_aux + 1) * s.hidden * 2 + 4 * 8)
    acts = activation_terms(s, bf16, loss_chunk)
    parts[ACTIVATIONS] = sum(acts.values())
    parts[LOSS_BACKWARD] = loss_backward_bytes(s, loss_chunk, bf16)
    parts.update(beside or {})
    # the loss's backward runs first, on top of every activation, before any gradient of a weight exists: the
    # peak
    # holds the larger of the two, not both
    peak = sum(parts.values()) - min(parts[LOSS_BACKWARD], parts["gradients (fp32)"])
    return {
        "parts": parts,
        "activation_terms": acts,
        "peak": peak,
        "world_size": world_size,
        "strategy": strategy,
        "bf16": bf16,
    }


LOSS_BACKWARD = "loss backward working set (not with the gradients)"
ACTIVATIONS = "activations (TTT forward, kept for backward)"


def loss_backward_bytes(s: DraftShape, loss_chunk: int | None = None, bf16: bool = False) -> int:
    """The KL loss's backward over the draft vocabulary of the last TTT step, alive at the start of the
    backward
    (measured: the peak). Eager: about seven [T, Vd] fp32 temporaries (gradients of the log-probs, xlogy, the
    products). Chunked: the logits' gradient [T, Vd] and three [chunk, Vd] fp32 softmaxes."""
    if loss_chunk:
        return (
            s.tokens * s.draft_vocab * (2 if bf16 else 4) + 3 * min(loss_chunk, s.tokens) * s.draft_vocab * 4
        )
    return 7 * s.tokens * s.draft_vocab * 4


def draft_params(model) -> DraftParams:
    """Counts from a built draft (the meta device is enough: only shapes and requires_grad are read)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    units = [
        *model.layers,
        model.fc,
        model.embed_tokens,
        model.lm_head,
        model.verifier_lm_head,
    ]  # fsdp.shard's
    sizes = [sum(p.numel() for p in u.parameters()) for u in units]
    trainable_sizes = [sum(p.numel() for p in u.parameters() if p.requires_grad) for u in units]
    linear = sum(
        m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.requires_grad
    )
    return DraftParams(trainable, frozen, max(sizes), linear, max(trainable_sizes))


def attention_pairs(document_ids: torch.Tensor, ttt_steps: int) -> list[int]:
    """(query, key) pairs the draft's attention mask lets through at each TTT step, for one pack's document
    ids
    (-1 = padding): a query attends causally within its document, and at step j also to its own position in
    each
    of the j earlier steps' keys (speculators' create_combined_mask_mod, extended once per step)."""
    ids = document_ids.flatten().tolist()
    causal, run, prev = 0, 0, None
    for d in ids:
        run = run + 1 if d == prev else 1
        prev = d
        if d != -1:
            causal += run
    real = sum(d != -1 for d in ids)
    return [causal + j * real for j in range(ttt_steps)]


def attention_model_flops(document_ids: torch.Tensor, ttt_steps: int, heads: int, head_dim: int) -> int:
    """Model FLOPs of the attention over all TTT steps, forward and backward: 12 per (query, key) pair the
    mask
    lets through, per head and head dim (QK^T and PV forward, 2 each per multiply-add; their four gradients
    backward). Masked pairs and the backward's recomputation of QK^T are not counted: the dense-mask sdpa
    computes
    the first and FlexAttention skips most of them, and neither is the model's work (PaLM's MFU)."""
    return 12 * heads * head_dim * sum(attention_pairs(document_ids, ttt_steps))


def random_draft(
    s: DraftShape, vocab: int = 2048, device: str | torch.device = "cpu", seed: int = 0, attn: str = "sdpa"
):
    """speculators' real draft at shape `s` (random init, fp32 parameters on `device`) and one random pack of
    s.tokens tokens (one document) on the same device: what the memory counter and the GPU step bench run."""
    from types import SimpleNamespace

    from pipeline.models import draft

    shape = SimpleNamespace(
        vocab_size=vocab,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        rms_norm_eps=1e-6,
        max_position_embeddings=max(65536, 2 * s.tokens),
        architectures=[],
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = draft.build(
            None,
            shape,
            list(range(1, s.n_aux + 1)),
            None,
            None,
            s.ttt_steps,
            attn=attn,
            load_target_weights=False,
            draft_vocab_size=s.draft_vocab,
        )
        model.d2t, model.t2d = (
            torch.zeros(s.draft_vocab, dtype=torch.long),
            torch.zeros(vocab, dtype=torch.bool),
        )
        T = s.tokens
        batch = dict(
            hidden_states=torch.randn(1, T, s.n_aux * s.hidden),
            input_ids=torch.randint(0, vocab, (1, T)),
            document_ids=torch.zeros(1, T, dtype=torch.long),
            loss_mask=torch.ones(1, T, dtype=torch.bool),
            position_ids=torch.arange(T)[None],
            verifier_last_hidden_states=torch.randn(1, T, s.hidden),
        )
    return model, batch


def measure_draft(s: DraftShape, bf16: bool, vocab: int = 2048, loss_chunk: int | None = None):
    """One TTT forward + backward of speculators' real draft at shape `s` (random init, CPU), counted by
    LiveTensors: (bytes alive after the forward, the peak, the draft's DraftParams). What the memory model is
    checked against (tests/unit/test_memory.py, scripts/bench/memory_estimate.py)."""
    from pipeline.models import losses

    model, batch = random_draft(s, vocab)
    live = LiveTensors([*model.parameters(), *model.buffers(), *batch.values()])
    with live, torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        _, loss, _ = model(
            **batch, ttt_steps=s.ttt_steps, loss_config=losses.loss_config("kl_div", loss_chunk)
        )
        after_forward = live.now
        loss.backward()
    return after_forward, live.peak, draft_params(model)


class LiveTensors(TorchDispatchMode):
    """Bytes of storages created under this mode and still alive: `now`, and the highest it reached, `peak`.
    `existing` tensors (parameters, the batch) are not counted, nor are views of them made under the mode."""

    def __init__(self, existing=()):
        super().__init__()
        self.live: dict[int, int] = {}
        self.ignored = {t.untyped_storage()._cdata for t in existing}
        self.now = self.peak = 0

    def _count(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live or key in self.ignored:
            return
        self.live[key] = storage.nbytes()
        self.now += self.live[key]
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._count(t)
        return out
