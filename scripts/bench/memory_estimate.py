"""Benchmark (CPU): `eaglepipe plan`'s memory model against the bytes the real draft keeps (issue #15).

LiveTensors counts every storage created during one TTT forward + backward of speculators' real
Eagle3DraftModel (random init): the SmolLM2-135M draft at 2K packs and a Llama-3.1-8B-shaped draft (hidden
4096, draft vocab 32,000) at 512-token packs, each in fp32 and under bf16 autocast (the GPU's setting), beside
pipeline/models/memory.py's estimate. Per-GPU peaks for other targets: `eaglepipe plan target=... ...`.
    .venv/bin/python scripts/bench/memory_estimate.py   # ~2 min on 2 cores -> results/memory_estimate.json
"""

import json
import sys
import time
from pathlib import Path

import bench_json
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from pipeline.models import memory  # noqa: E402

MEASURED = {  # name: (H, I, heads, kv heads, head dim, draft vocab, target vocab, tokens, TTT steps)
    "smollm2-135m draft, 2K pack, TTT 3": (576, 1536, 9, 3, 64, 2048, 49152, 2048, 3),
    "llama-3.1-8b-shaped draft, 512 pack, TTT 3": (4096, 14336, 32, 8, 128, 32000, 128256, 512, 3),
}


def measure(H, I, nh, nkv, hd, Vd, V, T, k, bf16: bool) -> dict:  # noqa: E741
    s = memory.DraftShape(T, k, H, I, nh, nkv, hd, Vd)
    t0 = time.time()
    after_forward, peak, params = memory.measure_draft(s, bf16, vocab=V, loss_chunk=None)  # eager loss
    acts = sum(memory.activation_terms(s, bf16).values()) + (2 * params.linear_trainable if bf16 else 0)
    bound = acts + max(4 * params.trainable, memory.loss_backward_bytes(s))
    r = {"precision": "bf16 autocast" if bf16 else "fp32", "seconds": round(time.time() - t0, 1)}
    r |= {"measured_after_forward_bytes": after_forward, "estimated_after_forward_bytes": acts}
    r |= {"measured_peak_bytes": peak, "estimated_peak_bytes": bound}
    r |= {"after_forward_ratio": round(acts / after_forward, 4), "peak_ratio": round(bound / peak, 4)}
    print(f"hidden {H}, {T} tokens:", json.dumps(r), flush=True)
    return r


def main() -> None:
    res = bench_json.header("memory_estimate", torch=torch.__version__, torch_threads=torch.get_num_threads())
    res["measured"] = {
        name: [measure(*dims, bf16) for bf16 in (False, True)] for name, dims in MEASURED.items()
    }
    print("->", bench_json.write(res, "memory_estimate", Path(__file__).parent / "results"))


if __name__ == "__main__":
    main()
