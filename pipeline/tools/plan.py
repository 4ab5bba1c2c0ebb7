"""`eaglepipe plan`: the draft's training memory per GPU, computed before anything is bought or queued.

    eaglepipe plan target=kimi_k25 train.tokens_per_pack=8192 train.ttt_steps=7 plan.world_size=8
    train.strategy=fsdp

The draft is built on the meta device at the target's declared shape (conf/target/*.yaml; no weights, no
memory) for its parameter counts; pipeline/models/memory.py adds up parameters, gradients, AdamW, DDP buckets
or FSDP shards, the batch and the TTT activations (docs/scale.md: what each term is and how it was checked).
Prints a table per part, the peak, and whether it fits `plan.gpu_memory_gib`; writes nothing.
"""

from __future__ import annotations

import json
import logging

from rich.console import Console
from rich.table import Table

from pipeline.capture import features
from pipeline.capture.aux_layers import aux_layer_ids
from pipeline.errors import UserError
from pipeline.formats import vocab_map
from pipeline.models import draft, memory

log = logging.getLogger(__name__)


def shape_of(cfg) -> memory.DraftShape:
    t = cfg.target
    missing = [
        k
        for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
        if t.get(k) is None
    ]
    if missing:
        raise UserError(
            f"plan: target {t.name} declares no {', '.join(missing)}; add the "
            "target's layer shape to its conf/target/*.yaml (as kimi_k25.yaml does)"
        )
    if str(getattr(cfg.train.draft_arch, "value", cfg.train.draft_arch)) != "llama":
        raise UserError("plan: the memory model covers the Llama draft layer (train.draft_arch=llama) only")
    return memory.DraftShape(
        tokens=cfg.train.tokens_per_pack,
        ttt_steps=cfg.train.ttt_steps,
        hidden=t.hidden_size,
        intermediate=t.intermediate_size,
        heads=t.num_attention_heads,
        kv_heads=t.num_key_value_heads,
        head_dim=t.head_dim,
        draft_vocab=min(cfg.vocab.draft_vocab_size, t.vocab_size),
    )


def compute(cfg) -> dict:
    p = cfg.plan  # world_size and precision: config_limits, checked before any tool runs
    shape = shape_of(cfg)
    aux = aux_layer_ids(cfg.extract.aux_layers, cfg.target.num_layers)
    model = draft.build_on_meta(cfg.target, shape.draft_vocab, aux, shape.ttt_steps)
    params = memory.draft_params(model)
    strategy = str(getattr(cfg.train.strategy, "value", cfg.train.strategy))
    target_params, counted = target_parameters(cfg, shape)
    beside = {}
    if features.online(cfg):  # the target in extract's dtype, auto = bf16 on GPU
        beside[ONLINE_TARGET] = (4 if cfg.extract.dtype in ("fp32", "float32") else 2) * target_params
    # the probe's target is fp32 on eval.device: auto = the device a planned run trains on (plan.precision
    # bf16: a GPU, where it counts; fp32: the CPU, whose memory this plan does not model)
    on_gpu = cfg.eval.device not in ("cpu", "auto") or (cfg.eval.device == "auto" and p.precision == "bf16")
    if cfg.train.eval_tau_every_steps and on_gpu:
        beside[PROBE_TARGET] = 4 * target_params
    est = memory.estimate(
        shape,
        params,
        p.world_size,
        strategy,
        bf16=p.precision == "bf16",
        loss_chunk=cfg.train.loss_chunk_tokens,
        beside=beside,
    )
    est.update(
        target=cfg.target.name,
        shape=shape.__dict__,
        params=params.__dict__,
        aux_layer_ids=aux,
        target_parameters=target_params,
        target_parameters_from=counted,
        gpu_memory_gib=p.gpu_memory_gib,
        fits=est["peak"] <= p.gpu_memory_gib * memory.GIB,
    )
    return est


WEIGHT_PARTS = ("frozen parameters", "trainable parameters", "gradients", "AdamW", "DDP", "FSDP", "autocast")


def by_draft_vocab(cfg) -> list[dict]:
    """The plan at each of vocab_map.COMPARED_SIZES below the target's vocabulary, at
    vocab.draft_vocab_size and at the full vocabulary: the draft's weights with their gradients, AdamW
    moments, buckets and casts (its lm_head is draft vocab x hidden, trainable or frozen as the draft builds
    it), the loss's bytes (the draft-vocabulary activation terms and the loss backward), the peak."""
    V, rows = int(cfg.target.vocab_size), []
    for K in sorted(
        {k for k in vocab_map.COMPARED_SIZES if k < V} | {V, min(int(cfg.vocab.draft_vocab_size), V)}
    ):
        c = cfg.copy()
        c.vocab.draft_vocab_size = K
        est = compute(c)
        loss = sum(b for term, b in est["activation_terms"].items() if "vocab" in term)
        rows.append(
            {
                "draft_vocab": K,
                "lm_head_parameters": K * int(cfg.target.hidden_size),
                "weight_bytes": sum(b for part, b in est["parts"].items() if part.startswith(WEIGHT_PARTS)),
                "loss_bytes": loss + est["parts"][memory.LOSS_BACKWARD],
                "peak": est["peak"],
                "fits": est["fits"],
            }
        )
    return rows


ONLINE_TARGET = "target weights, extract.dtype (train.features=online: every rank holds one)"
PROBE_TARGET = "tau probe's target, fp32 (train.eval_tau_every_steps: rank 0, on eval.device)"


def target_parameters(cfg, shape: memory.DraftShape) -> tuple[int, str]:
    """The target's parameter count and where it comes from: declared (target.num_parameters), or a dense
    estimate
    from the declared layer shape."""
    t = cfg.target
    if t.get("num_parameters"):
        return int(t.num_parameters), "declared (target.num_parameters)"
    return memory.dense_target_params(
        t.num_layers, shape, t.vocab_size
    ), "dense estimate from the layer shape"


def run(cfg) -> None:
    est = compute(cfg)
    s, gib = est["shape"], memory.GIB
    table = Table(
        title=f"eaglepipe plan: {est['target']} draft, {s['tokens']:,}-token packs, TTT {s['ttt_steps']}, "
        f"{est['world_size']} x {est['strategy'].upper()}, {'bf16 autocast' if est['bf16'] else 'fp32'}"
        " (computed, per GPU)"
    )
    table.add_column("part")
    table.add_column("GiB", justify="right")
    for name, value in est["parts"].items():
        table.add_row(name, f"{value / gib:.2f}")
        if name == memory.ACTIVATIONS:  # its breakdown right under it
            for term, b in est["activation_terms"].items():
                table.add_row(f"  {term}", f"{b / gib:.2f}", style="dim")
    table.add_row("peak (upper bound)", f"{est['peak'] / gib:.2f}", style="bold")
    Console(width=140).print(table)
    p = est["params"]
    verdict = "fits" if est["fits"] else "does NOT fit"
    print(
        f"draft: {p['trainable']:,} trainable + {p['frozen']:,} frozen parameters (aux layers "
        f"{est['aux_layer_ids']}); {verdict} in {est['gpu_memory_gib']:g} GiB"
    )
    if ONLINE_TARGET in est["parts"] or PROBE_TARGET in est["parts"]:
        print(f"target: {est['target_parameters']:,} parameters ({est['target_parameters_from']})")
    chunk = cfg.train.loss_chunk_tokens
    print(
        f"loss: chunked KL, {chunk} positions a chunk"
        if chunk
        else "loss: eager (train.loss_chunk_tokens=null)"
    )
    _print_by_draft_vocab(cfg, est)
    print(
        "json: "
        + json.dumps({k: est[k] for k in ("target", "world_size", "strategy", "bf16", "peak", "fits")})
    )


def _print_by_draft_vocab(cfg, est: dict) -> None:
    gib, table = memory.GIB, Table(title="the same plan by draft vocabulary size (vocab.draft_vocab_size)")
    for col in ("draft vocab", "lm_head params", "weights, grads, AdamW GiB", "loss GiB", "peak GiB", ""):
        table.add_column(col, justify="right")
    for r in by_draft_vocab(cfg):
        mark = "this run" if r["draft_vocab"] == est["shape"]["draft_vocab"] else ""
        full = " (full)" if r["draft_vocab"] == cfg.target.vocab_size else ""
        table.add_row(
            f"{r['draft_vocab']:,}{full}",
            f"{r['lm_head_parameters']:,}",
            f"{r['weight_bytes'] / gib:.2f}",
            f"{r['loss_bytes'] / gib:.2f}",
            f"{r['peak'] / gib:.2f}" + ("" if r["fits"] else " (does not fit)"),
            mark,
        )
    Console(width=140).print(table)
