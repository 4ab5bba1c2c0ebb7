"""Benchmark (GPU): MFU and peak memory of our training step for a large draft (issue #14), beside
`eaglepipe plan`'s estimate. The draft is speculators' Eagle3DraftModel at a target's declared layer shape
(conf/target/NAME.yaml), random init, trained as stage train trains it (bf16 autocast, the configured loss,
AdamW, clipping) on random features (this measures the step, not the loader). FLOPs are torch's own count
(FlopCounterMode over one step run eagerly), but for the attention, which the counter counts as dense-mask
sdpa computes it (every masked pair, 14 per pair, head and head dim): it is replaced by the model's attention
FLOPs (memory.attention_model_flops: 12 per pair the mask lets through). MFU = model FLOPs per second / the
GPU's dense bf16 peak (--peak-tflops); `mfu_counted` keeps the counter's total (flex skips 7/8 of it).
Usage:  python scripts/bench/train_mfu.py --target llama3_8b --tokens 8192 16384 --ttt 7 --steps 8 --profile
Writes train_mfu.json (bench_json: $OUT, else the current folder), a row at a time.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import bench_json
import torch
from omegaconf import OmegaConf
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from pipeline.models import losses, memory  # noqa: E402
from pipeline.tools import plan  # noqa: E402


def shape_of(target: str, tokens: int, ttt: int, draft_vocab: int) -> tuple[memory.DraftShape, int]:
    """The draft's shape as `eaglepipe plan` reads it from conf/target/NAME.yaml; the target's vocab size."""
    t = OmegaConf.load(ROOT / "conf" / "target" / f"{target}.yaml")
    train = {"tokens_per_pack": tokens, "ttt_steps": ttt, "draft_arch": "llama"}
    cfg = OmegaConf.create({"target": t, "train": train, "vocab": {"draft_vocab_size": draft_vocab}})
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
    """FLOPs of one whole step, counted eagerly (the counter sees every aten op; inside a compiled graph it
    would see none). FlexAttention has no eager path under the counter's mode, so its rows are counted on the
    same draft with sdpa (dense masks: the masked positions counted, as sdpa computes them)."""
    model, batch = memory.random_draft(s, vocab, device, attn=attn)
    step, _ = _step_fn(model, batch, s, chunk, device)
    with torch.compiler.set_stance("force_eager"), FlopCounterMode(display=False) as counter:
        step()
    attn_counted = sum(v for op, v in counter.get_flop_counts()["Global"].items() if "attention" in str(op))
    attn_model = memory.attention_model_flops(batch["document_ids"], s.ttt_steps, s.heads, s.head_dim)
    return counter.get_total_flops(), attn_counted, attn_model


def one(s: memory.DraftShape, vocab: int, a, device, attn: str) -> dict:
    """One row: the step's FLOPs (counted), time, peak memory and (a.profile) its profile."""
    chunk = a.loss_chunk or None
    torch._dynamo.reset()  # each row compiles its own static shapes (no graph made dynamic by the row before)
    flops_attn = "sdpa" if "flex" in attn else attn
    flops, attn_counted, attn_model = count_flops(s, vocab, chunk, device, flops_attn)
    flops_model = flops - attn_counted + attn_model  # the model's work: no masked pairs, no recomputation
    if device.type == "cuda":
        torch.cuda.empty_cache()
    model, batch = memory.random_draft(s, vocab, device, attn=attn)
    step, trainable = _step_fn(model, batch, s, chunk, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(a.warmup):  # compilation (speculators compiles on CUDA), the allocator settles
        step()
    sync()
    if device.type == "cuda":  # the peak of the timed steps (what a long run holds), not of the eager count
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    sync()
    dt = (time.perf_counter() - t0) / a.steps
    est = memory.estimate(s, memory.draft_params(model), loss_chunk=chunk)
    prof = profile_steps(step, sync, device) if a.profile else None
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    row = {"attn": attn, "tokens": s.tokens, "ttt_steps": s.ttt_steps, "draft_vocab": s.draft_vocab}
    row |= {"target_vocab": vocab, "trainable_params": sum(p.numel() for p in trainable), "step_s": dt}
    row |= {"flops_per_step": flops, "flops_counted_with": flops_attn, "peak_allocated_gib": peak}
    row |= {"attention_flops_counted": attn_counted, "attention_flops_model": attn_model}
    row |= {"flops_model_per_step": flops_model, "tokens_per_s": s.tokens / dt}
    row |= {"tflops_per_s": flops_model / dt / 1e12, "tflops_per_s_counted": flops / dt / 1e12}
    row["estimate_gib"] = round(est["peak"] / 2**30, 2)
    return row | ({"profile": prof} if prof else {})


KINDS = (  # (kind, substrings of kernel names), first match wins: fmha_cutlass* is attention, not gemm
    ("attention", "flash fmha attention flex"),
    (
        "gemm",
        "gemm gemv cutlass xmma nvjet matmul triton_tem_fused_mm triton_tem_fused_addmm triton_tem_fused_bmm",
    ),
    ("attention", "triton_tem_fused"),  # inductor's other template: flex attention
    ("loss_softmax", "softmax kl_div logsumexp cross_entropy"),
    ("optimizer", "adam foreach multi_tensor"),
)


def kind_of(name: str) -> str:
    n = name.lower()
    return next((k for k, keys in KINDS if any(x in n for x in keys.split())), "other")


def profile_steps(step, sync, device, n: int = 2) -> dict:
    """What binds the step: `n` steps under torch.profiler (after the timed ones). The device's busy time
    (union of kernel intervals) over the wall, and the device time by kind of kernel (matmuls, attention,
    loss, optimizer, the rest: elementwise, norms, copies) with the heaviest kernels by name."""
    from torch.profiler import ProfilerActivity, profile

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
    busy = busy_us(kern) / 1e6
    top = sorted(by_name.items(), key=lambda x: -x[1])[:12]
    fractions = {k: round(v / total, 3) for k, v in sorted(by_kind.items())}
    out = {"steps": n, "wall_s": round(wall, 4), "gpu_busy_s": round(busy, 4), "kernels": len(kern)}
    out |= {"gpu_busy_fraction": round(busy / wall, 3), "device_time_fraction_by_kind": fractions}
    out["top_kernels"] = [
        {"name": k[:120], "fraction": round(v / total, 3), "kind": kind_of(k)} for k, v in top
    ]
    return out


def busy_us(kernels) -> float:
    """The device's busy time: the union of the kernels' intervals (overlapping streams counted once)."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted((k.time_range.start, k.time_range.end) for k in kernels):
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    return busy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="llama3_8b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--loss-chunk", type=int, default=2048, help="train.loss_chunk_tokens; 0 = eager")
    help = "train.attn_implementation values (sdpa: dense masks; simple_flex_attention: block masks)"
    ap.add_argument("--attn", nargs="+", default=["sdpa"], help=help)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU")
    help = "2 steps under torch.profiler after the timed ones: GPU busy fraction, device time by kernel kind"
    ap.add_argument("--profile", action="store_true", help=help)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    rows, extra = [], {"device": name, "torch": torch.__version__, "target_shape": a.target}
    for attn in a.attn:
        for T in a.tokens:
            s, vocab = shape_of(a.target, T, a.ttt, a.draft_vocab)
            try:
                r = one(s, vocab, a, device, attn)
            except Exception as e:  # noqa: BLE001 - a row that fails (out of memory...) is recorded
                error = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                r = {"attn": attn, "tokens": T, "ttt_steps": a.ttt, "error": error}
            if "tflops_per_s" in r:
                r["mfu"] = r["tflops_per_s"] / a.peak_tflops
                r["mfu_counted"] = r["tflops_per_s_counted"] / a.peak_tflops
            rows.append(r)
            print(json.dumps(r), flush=True)
            res = bench_json.header("train_mfu", **extra, peak_tflops=a.peak_tflops, rows=rows)
            bench_json.write(res, "train_mfu")  # after every row: a row that kills the process loses nothing


if __name__ == "__main__":
    main()
