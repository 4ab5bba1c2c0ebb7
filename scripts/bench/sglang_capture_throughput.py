"""Benchmark (GPU box with SGLang): capture through SGLang's ModelRunner beside SGLang's own plain prefill.

Same prepared samples, same length-bucketed batches as `extract` (extract.plan_shards / plan_batches), one
ModelRunner (pipeline/engines/sglang_capture.build_runner), two measurements, each the best of 3 passes:
  prefill  - SGLang's extend forward with no capture (CaptureHiddenMode.NULL, nothing copied back)
  capture  - what extract.backend=sglang does per batch: FULL aux capture + last-state hook + bf16, packed
             (SGLangCapture.packed, no padding), asynchronous copies into pinned host memory (extract._to_host)
The extract stage end to end (writing the store) is timed by the stage itself (stages.json).
Usage (a process with /tmp/sgl-site first on PYTHONPATH):
  python scripts/bench/sglang_capture_throughput.py RUN_DIR TARGET_DIR [attention_backend] [mem_fraction]
Writes RUN_DIR/bench_sglang_capture.json (and $OUT/ if set).
"""

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from pipeline.stages import extract  # noqa: E402
from pipeline.engines import hf_capture  # noqa: E402
from pipeline.engines import sglang_capture as sc  # noqa: E402
from pipeline.formats import prepared  # noqa: E402


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def plain_forward(runner, reqs, tree_cache) -> None:
    """SGLang's own extend forward of the batch, nothing captured (the baseline capture is measured against)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch

    try:
        batch = sc.extend_batch(reqs, runner.req_to_token_pool, runner.token_to_kv_pool_allocator, tree_cache,
                                runner.model_config)
        runner.forward(ForwardBatch.init_new(batch, runner, capture_hidden_mode=CaptureHiddenMode.NULL,
                                             return_hidden_states_before_norm=False))
    finally:
        runner.req_to_token_pool.clear()
        runner.token_to_kv_pool_allocator.clear()


def main(run_dir: str, target_dir: str, attention_backend: str = "triton", mem_fraction: str = "0.5") -> None:
    import sglang

    ds, _ = prepared.load(run_dir)
    ids_all = ds["input_ids"]
    lengths = np.array([len(x) for x in ids_all])
    batches = []
    for spec in extract.plan_shards(lengths, 262144):
        for b in extract.plan_batches(spec.lengths, 65536, 256):
            batches.append(hf_capture.pad_batch([ids_all[spec.sample_start + i] for i in b]))
    t0 = time.time()
    runner = sc.build_runner(target_dir, 0, 1, int(os.environ.get("EAGLEPIPE_NCCL_PORT", 29531)),
                             float(mem_fraction), attention_backend)
    build_s = time.time() - t0
    n_layers = runner.model_config.hf_config.num_hidden_layers
    aux = hf_capture.aux_layer_ids(None, n_layers)
    cache = sc.disabled_prefix_cache(runner.req_to_token_pool, runner.token_to_kv_pool_allocator)
    samples = [[row[:n].tolist() for row, n in zip(i, a.sum(1).tolist())] for i, a in batches]

    def prefill():
        for j, s in enumerate(samples):
            plain_forward(runner, sc.make_reqs(s, j * 1000), cache)

    prefill()  # warm-up (triton kernels, allocator)
    prefill_s = min(timed(prefill) for _ in range(3))
    cap = sc.SGLangCapture(runner, aux)

    def capture():
        copies = []
        for s in samples:
            copies += [extract._to_host(h) for h in cap.packed(s)]
        for _, event in copies:
            event.synchronize()

    capture()
    capture_s = min(timed(capture) for _ in range(3))
    n = int(lengths.sum())
    res = {"sglang": sglang.__version__, "device": torch.cuda.get_device_name(), "attention_backend": attention_backend,
           "tokens": n, "samples": len(lengths), "batches": len(batches), "aux_layer_ids": aux,
           "runner_build_s": round(build_s, 1), "prefill_s": prefill_s, "capture_s": capture_s,
           "prefill_tokens_per_s": n / prefill_s, "capture_tokens_per_s": n / capture_s,
           "capture_over_prefill": prefill_s / capture_s, "date": time.strftime("%Y-%m-%d"),
           "command": " ".join(["python", *sys.argv])}
    for where in [Path(run_dir), Path(os.environ["OUT"]) if os.environ.get("OUT") else None]:
        if where is not None:
            (where / "bench_sglang_capture.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    cap.remove()


if __name__ == "__main__":
    main(*sys.argv[1:])
