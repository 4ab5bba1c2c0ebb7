"""Benchmark: `eaglepipe plan`'s memory model against the bytes the real draft keeps (CPU), and its answers.

Measured (CPU, LiveTensors: every storage created during one TTT forward + backward of speculators' real
Eagle3DraftModel, random init): the SmolLM2-135M draft at 2K packs and a Llama-3.1-8B-shaped draft (hidden
4096, draft vocab 32,000) at 512-token packs, each in fp32 and under bf16 autocast (the GPU's setting).
Computed: per-GPU peaks for SmolLM2, Llama-3.1-8B and Kimi-K2.5 drafts, DDP and FSDP, 1 and 8 GPUs.

    .venv/bin/python scripts/bench/memory_estimate.py      # ~2 min on 2 cores; writes results/memory_estimate.json
"""

import json
import platform
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from pipeline.config import register  # noqa: E402
from pipeline.models import memory  # noqa: E402
from pipeline.tools import plan  # noqa: E402

MEASURED = {  # name: (H, I, heads, kv heads, head dim, draft vocab, target vocab, tokens, TTT steps)
    "smollm2-135m draft, 2K pack, TTT 3": (576, 1536, 9, 3, 64, 2048, 49152, 2048, 3),
    "llama-3.1-8b-shaped draft, 512 pack, TTT 3": (4096, 14336, 32, 8, 128, 32000, 128256, 512, 3),
}
PLANS = [("smollm2", 2048, 3, 2048), ("llama3_8b", 8192, 7, 32000), ("llama3_8b", 16384, 7, 32000),
         ("kimi_k25", 8192, 7, 32000), ("kimi_k25", 16384, 7, 32000)]


def measure(H, I, nh, nkv, hd, Vd, V, T, k, bf16: bool) -> dict:
    s = memory.DraftShape(T, k, H, I, nh, nkv, hd, Vd)
    t0 = time.time()
    after_forward, peak, params = memory.measure_draft(s, bf16, vocab=V, loss_chunk=None)  # speculators' eager loss
    acts = sum(memory.activation_terms(s, bf16).values()) + (2 * params.linear_trainable if bf16 else 0)
    bound = acts + max(4 * params.trainable, memory.loss_backward_bytes(s))
    return {"precision": "bf16 autocast" if bf16 else "fp32", "seconds": round(time.time() - t0, 1),
            "measured_after_forward_bytes": after_forward, "estimated_after_forward_bytes": acts,
            "after_forward_ratio": round(acts / after_forward, 4),
            "measured_peak_bytes": peak, "estimated_peak_bytes": bound,
            "peak_ratio": round(bound / peak, 4)}


def main() -> None:
    register()
    out = {"name": "memory_estimate", "date": time.strftime("%Y-%m-%d"),
           "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
           "command": "python scripts/bench/memory_estimate.py",
           "what": "activation + gradient bytes of one TTT forward/backward of the real draft, counted by LiveTensors "
                   "(CPU; no GPU time this session) vs pipeline/models/memory.py; then computed per-GPU peaks",
           "measured": {}, "plans": []}
    for name, dims in MEASURED.items():
        out["measured"][name] = [measure(*dims, bf16) for bf16 in (False, True)]
        for r in out["measured"][name]:
            print(f"{name:45s} {r['precision']:14s} after forward {r['measured_after_forward_bytes'] / 2**20:9.1f} MiB "
                  f"measured, x{r['after_forward_ratio']:.3f} estimated; peak {r['measured_peak_bytes'] / 2**20:9.1f} "
                  f"MiB, bound x{r['peak_ratio']:.3f}", flush=True)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for target, tokens, ttt, vocab in PLANS:
            for (world, strategy), chunk in ((w, c) for w in ((1, "ddp"), (8, "ddp"), (8, "fsdp")) for c in ("null", 2048)):
                cfg = compose(config_name="config", overrides=[
                    f"target={target}", f"train.tokens_per_pack={tokens}", f"train.ttt_steps={ttt}",
                    f"vocab.draft_vocab_size={vocab}", f"plan.world_size={world}", f"train.strategy={strategy}",
                    f"train.loss_chunk_tokens={chunk}", "run_dir=/tmp/unused", "cache_dir=/tmp/unused"])
                est = plan.compute(cfg)
                row = {"target": target, "tokens_per_pack": tokens, "ttt_steps": ttt, "draft_vocab": vocab,
                       "world_size": world, "strategy": strategy, "loss": "eager" if chunk == "null" else f"chunked {chunk}",
                       "peak_gib": round(est["peak"] / 2**30, 2),
                       "activations_gib": round(est["parts"]["activations (TTT forward, kept for backward)"] / 2**30, 2),
                       "params": est["params"], "fits_139_gib": est["fits"]}
                out["plans"].append(row)
                print(f"{target:10s} T={tokens:6d} TTT {ttt} {world} x {strategy} {row['loss']:12s}: peak {row['peak_gib']:7.2f} GiB "
                      f"(activations {row['activations_gib']:.2f})", flush=True)
    path = ROOT / "scripts" / "bench" / "results" / "memory_estimate.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
