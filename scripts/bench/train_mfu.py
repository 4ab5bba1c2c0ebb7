"""Benchmark (GPU): MFU and peak memory of our training step for a large draft (issue #14: >= 40% MFU for the
Llama-3.1-8B-shaped draft; peak memory at 8K and 16K packs beside `eaglepipe plan`'s estimate).

The draft is speculators' Eagle3DraftModel at a target's declared layer shape (conf/target/NAME.yaml: hidden,
heads, intermediate), random init, fp32 master weights, trained as stage train trains it: bf16 autocast, the
loss train.loss_chunk_tokens configures, AdamW (0.9, 0.95) on the trainable parameters, gradient clipping. The
features are random, made on the GPU (no target, no store: this measures the step, not the loader).
FLOPs are counted by torch itself (torch.utils.flop_counter.FlopCounterMode over one whole step run eagerly: every
TTT step's forward and backward), but for the attention: the counter counts it as the dense-mask sdpa computes it
(every masked pair, and the backward's recomputation of QK^T: 14 per pair, per head and head dim), so its attention
ops are replaced by the model's attention FLOPs (memory.attention_model_flops: 12 per pair the mask lets through).
MFU = model FLOPs per second / the GPU's dense bf16 peak (--peak-tflops, 989 for an H100/H200 SXM); `mfu_counted`
keeps the counter's own total (which put FlexAttention's 16K step at 98% on 2026-12-02: it skips 7/8 of what sdpa
computes, so the dense count is not its work).
Usage:  python scripts/bench/train_mfu.py --target llama3_8b --tokens 8192 16384 --ttt 7 --steps 10 [--profile]
Writes train_mfu.json to $OUT (or the current folder) and prints a table.
"""

import argparse
import json
import os
import socket
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from pipeline.models import losses, memory  # noqa: E402
from pipeline.tools import plan  # noqa: E402


def shape_of(target: str, tokens: int, ttt: int, draft_vocab: int) -> tuple[memory.DraftShape, int]:
    """The draft's shape as `eaglepipe plan` reads it from conf/target/NAME.yaml, and the target's vocab size."""
    t = OmegaConf.load(ROOT / "conf" / "target" / f"{target}.yaml")
    cfg = OmegaConf.create({"target": t, "train": {"tokens_per_pack": tokens, "ttt_steps": ttt, "draft_arch": "llama"},
                            "vocab": {"draft_vocab_size": draft_vocab}})
    return plan.shape_of(cfg), int(t.vocab_size)


def _step_fn(model, batch, s: memory.DraftShape, chunk, device):
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4, betas=(0.9, 0.95))
    fwd = dict(ttt_steps=s.ttt_steps, loss_config=losses.loss_config("kl_div", chunk))

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            _, loss, _ = model(**batch, **fwd)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, trainable


def count_flops(s: memory.DraftShape, vocab: int, chunk, device, attn: str) -> tuple[int, int, int]:
    """FLOPs of one whole step, counted eagerly (the counter sees every aten op; inside a compiled graph it would
    see none). FlexAttention has no eager path under the counter's mode, so its rows are counted on the same draft
    with sdpa (dense masks: the masked positions counted, as sdpa computes them)."""
    model, batch = memory.random_draft(s, vocab, device, attn=attn)
    step, _ = _step_fn(model, batch, s, chunk, device)
    with torch.compiler.set_stance("force_eager"), FlopCounterMode(display=False) as counter:
        step()
    attn_counted = sum(v for op, v in counter.get_flop_counts()["Global"].items() if "attention" in str(op))
    attn_model = memory.attention_model_flops(batch["document_ids"], s.ttt_steps, s.heads, s.head_dim)
    return counter.get_total_flops(), attn_counted, attn_model


def one(s: memory.DraftShape, vocab: int, steps: int, warmup: int, chunk, device, attn: str = "sdpa",
        profile: bool = False) -> dict:
    torch._dynamo.reset()  # each row compiles its own static shapes (no graph made dynamic by the row before)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    flops_attn = "sdpa" if "flex" in attn else attn
    flops, attn_counted, attn_model = count_flops(s, vocab, chunk, device, flops_attn)
    flops_model = flops - attn_counted + attn_model  # the model's work: no masked pairs, no recomputation
    if device.type == "cuda":
        torch.cuda.empty_cache()
    model, batch = memory.random_draft(s, vocab, device, attn=attn)
    step, trainable = _step_fn(model, batch, s, chunk, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):  # compilation (speculators compiles its forward on CUDA) and the allocator settle
        step()
    sync()
    if device.type == "cuda":  # the peak of the timed steps (what a long run holds), not of the eager count
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    dt = (time.perf_counter() - t0) / steps
    est = memory.estimate(s, memory.draft_params(model), loss_chunk=chunk)
    prof = profile_steps(step, sync, device) if profile else None
    return {"attn": attn, "tokens": s.tokens, "ttt_steps": s.ttt_steps, "draft_vocab": s.draft_vocab, "target_vocab": vocab,
            "trainable_params": sum(p.numel() for p in trainable), "flops_per_step": flops, "flops_counted_with": flops_attn,
            "attention_flops_counted": attn_counted, "attention_flops_model": attn_model, "flops_model_per_step": flops_model,
            "step_s": dt, "tokens_per_s": s.tokens / dt, "tflops_per_s": flops_model / dt / 1e12,
            "tflops_per_s_counted": flops / dt / 1e12,
            "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None,
            "estimate_gib": round(est["peak"] / 2 ** 30, 2), **({"profile": prof} if prof else {})}


KINDS = (("attention", ("flash", "fmha", "attention", "flex")),   # before gemm: fmha_cutlass* is attention
         ("gemm", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "matmul", "triton_tem_fused_mm", "triton_tem_fused_addmm",
                   "triton_tem_fused_bmm")),
         ("attention", ("triton_tem_fused",)),                        # inductor's other template: flex attention
         ("loss_softmax", ("softmax", "kl_div", "logsumexp", "cross_entropy")),
         ("optimizer", ("adam", "foreach", "multi_tensor")))


def kind_of(name: str) -> str:
    n = name.lower()
    return next((k for k, keys in KINDS if any(x in n for x in keys)), "other")


def profile_steps(step, sync, device, n: int = 2) -> dict:
    """What binds the step: `n` steps under torch.profiler (after the timed ones). The device's busy time (union
    of kernel intervals) over the wall, and the device time by kind of kernel (matmuls, attention, loss, optimizer,
    the rest: elementwise, norms, copies) with the heaviest kernels by name."""
    from torch.profiler import ProfilerActivity, profile

    from train_profile import _busy_us
    if device.type != "cuda":
        return {}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        sync()
        wall = time.perf_counter() - t0
    kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_kind, by_name = {}, {}
    for e in kern:
        us, kind = e.time_range.end - e.time_range.start, kind_of(e.name)
        by_kind[kind] = by_kind.get(kind, 0.0) + us
        by_name[e.name] = by_name.get(e.name, 0.0) + us
    total = sum(by_kind.values()) or 1.0
    busy = _busy_us(prof.events()) / 1e6
    top = sorted(by_name.items(), key=lambda x: -x[1])[:12]
    return {"steps": n, "wall_s": round(wall, 4), "gpu_busy_s": round(busy, 4), "gpu_busy_fraction": round(busy / wall, 3),
            "kernels": len(kern), "device_time_fraction_by_kind": {k: round(v / total, 3) for k, v in sorted(by_kind.items())},
            "top_kernels": [{"name": k[:120], "fraction": round(v / total, 3), "kind": kind_of(k)} for k, v in top]}


def write(a, device, rows) -> None:
    res = {"bench": "train_mfu", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "host": socket.gethostname(), "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "command": "python scripts/bench/train_mfu.py " + " ".join(sys.argv[1:]),
           "target_shape": a.target, "peak_tflops": a.peak_tflops, "rows": rows}
    out = Path(os.environ.get("OUT") or ".")
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_mfu.json").write_text(json.dumps(res, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="llama3_8b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--loss-chunk", type=int, default=2048, help="train.loss_chunk_tokens; 0 = eager")
    ap.add_argument("--attn", nargs="+", default=["sdpa"],
                    help="train.attn_implementation values to compare (sdpa: dense masks; simple_flex_attention: block masks)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU")
    ap.add_argument("--profile", action="store_true", help="profile 2 steps after the timed ones: GPU busy fraction, "
                    "device time by kind of kernel (what binds the step)")
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for attn in a.attn:
        for T in a.tokens:
            s, vocab = shape_of(a.target, T, a.ttt, a.draft_vocab)
            try:
                r = one(s, vocab, a.steps, a.warmup, a.loss_chunk or None, device, attn, a.profile)
            except torch.OutOfMemoryError as e:
                r = {"attn": attn, "tokens": T, "ttt_steps": a.ttt, "error": f"out of memory: {str(e).splitlines()[0]}"}
            except Exception as e:  # noqa: BLE001 - a row that fails is recorded, the other rows still run
                r = {"attn": attn, "tokens": T, "ttt_steps": a.ttt, "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
            if "tflops_per_s" in r:
                r["mfu"] = r["tflops_per_s"] / a.peak_tflops
                r["mfu_counted"] = r["tflops_per_s_counted"] / a.peak_tflops
            rows.append(r)
            print(json.dumps(r), flush=True)
            write(a, device, rows)  # after every row: a later row that kills the process loses nothing
    print(f"{'attn':>22} {'tokens':>7} {'ttt':>4} {'step s':>8} {'tok/s':>9} {'TFLOP/s':>8} {'MFU':>6} {'counted':>8} "
          f"{'peak GiB':>9} {'est GiB':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['attn']:>22} {r['tokens']:>7} {r['ttt_steps']:>4}  {r['error']}")
            continue
        pk = r["peak_allocated_gib"]
        print(f"{r['attn']:>22} {r['tokens']:>7} {r['ttt_steps']:>4} {r['step_s']:>8.3f} {r['tokens_per_s']:>9.0f} {r['tflops_per_s']:>8.1f} "
              f"{r['mfu']:>6.1%} {r['mfu_counted']:>8.1%} {pk if pk is None else round(pk, 1)!s:>9} {r['estimate_gib']!s:>8}")


if __name__ == "__main__":
    main()
