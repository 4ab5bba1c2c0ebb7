"""Benchmark (GPU; issues #2, #14, #32): plain prefill vs capture vs the extract stage end to end; a backend.

The backend is extract.backend (hf: transformers and forward hooks; sglang: SGLang's ModelRunner, run with
/tmp/sgl-site first on PYTHONPATH). Same prepared samples, same length-bucketed batches as extract:
  end to end - `python -m pipeline stage=extract` in its own process (the GPU to itself): the stage's seconds
  prefill    - the target's forward alone, nothing captured (best of 3)
  capture    - the backend's Capture.packed per batch + asynchronous copies into pinned memory (best of 3)
Usage:  python scripts/bench/capture.py --key smollm2 [--name capture_h200] OVERRIDES... extract.backend=hf
Merges {KEY: {backend: figures}} into $OUT/NAME.json (issue #32's keys: KEY.BACKEND.capture_over_prefill,
KEY.BACKEND.end_to_end_over_prefill).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import bench_json
import numpy as np
import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from pipeline.capture import settings as capture_settings  # noqa: E402
from pipeline.capture import store as capture_store  # noqa: E402
from pipeline.capture.aux_layers import aux_layer_ids  # noqa: E402
from pipeline.capture.hf import Capture, pad_batch, plan_batches  # noqa: E402
from pipeline.config import register  # noqa: E402
from pipeline.engines import sglang_capture as sc  # noqa: E402
from pipeline.formats import prepared  # noqa: E402
from pipeline.models import targets  # noqa: E402


def best_of_3(fn) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    times = []
    for _ in range(4):  # the first is a warm-up (kernels, allocator)
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return min(times[1:])


def sglang_prefill(runner, cache, batches):
    """SGLang's own extend forward of every batch with nothing captured (CaptureHiddenMode.NULL)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch

    for j, samples in enumerate(batches):
        reqs = sc.make_reqs(samples, j * 100_000)
        try:
            pools = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
            b = sc.extend_batch(reqs, *pools, cache, runner.model_config)
            mode = {"capture_hidden_mode": CaptureHiddenMode.NULL, "return_hidden_states_before_norm": False}
            runner.forward(ForwardBatch.init_new(b, runner, **mode))
        finally:
            runner.req_to_token_pool.clear()
            runner.token_to_kv_pool_allocator.clear()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--key", required=True, help="the target's key in the results: smollm2, shape_8b")
    ap.add_argument("--name", default="capture_h200")
    a, overrides = ap.parse_known_args()
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    ex, backend = cfg.extract, capture_settings.backend(cfg)
    pipe = [sys.executable, "-m", "pipeline", *overrides]
    subprocess.run([*pipe, "stage=prepare"], check=True)
    subprocess.run([*pipe, "stage=extract", "extract.overwrite=true"], check=True)
    stages = json.loads((Path(cfg.run_dir) / "stages.json").read_text())
    store_bytes = sum(f.stat().st_size for f in (Path(cfg.run_dir) / "features").rglob("*") if f.is_file())
    ds, _ = prepared.load(cfg.run_dir)
    ids = [list(map(int, x)) for x in ds["input_ids"]]
    lengths = np.array([len(x) for x in ids])
    shards = capture_store.plan_shards(lengths, ex.shard_tokens)
    plans = [(s, b) for s in shards for b in plan_batches(s.lengths, ex.batch_tokens, ex.max_batch_size)]
    batches = [[ids[s.sample_start + i] for i in b] for s, b in plans]
    folder = targets.resolve(cfg.target, cfg.cache_dir)
    layers = targets.load_config(folder, cfg.target).num_hidden_layers
    aux = aux_layer_ids(ex.aux_layers, layers)
    t0 = time.perf_counter()
    if backend == "sglang":
        runner = sc.build_runner(
            str(folder), 0, 1, 29531, ex.sglang_mem_fraction, ex.sglang_attention_backend
        )
        cache = sc.disabled_prefix_cache(runner.req_to_token_pool, runner.token_to_kv_pool_allocator)
        prefill = lambda: sglang_prefill(runner, cache, batches)
        make_capture = lambda: sc.SGLangCapture(runner, aux)
    else:
        device, dtype = targets.pick_device_dtype(ex.device, ex.dtype)
        model = targets.load_model(folder, cfg.target, device, dtype, ex.attn_implementation)
        decoder, make_capture = model.get_decoder(), lambda: Capture(model, aux)
        padded = [tuple(t.to(device) for t in pad_batch(b)) for b in batches]  # inputs on the device first

        def prefill():
            with torch.inference_mode():
                for i, m in padded:
                    decoder(input_ids=i, attention_mask=m, use_cache=False)

    load_s = time.perf_counter() - t0
    prefill_s = best_of_3(prefill)  # before any hook or capture mode is on
    cap = make_capture()

    def capture():  # what extract does per batch: packed states, asynchronous copies into pinned memory
        for b in batches:
            for h in cap.packed(b):
                capture_store.to_host(h)

    secs = {"prefill": prefill_s, "capture": best_of_3(capture), "end_to_end": stages["extract"]["seconds"]}
    n = int(lengths.sum())
    row = {"tokens": n, "samples": len(ids), "batches": len(batches), "aux_layer_ids": aux}
    row["model_load_s"] = load_s
    row |= {f"{k}_s": v for k, v in secs.items()} | {f"{k}_tokens_per_s": n / v for k, v in secs.items()}
    row |= {f"{k}_over_prefill": prefill_s / secs[k] for k in ("capture", "end_to_end")}
    row["end_to_end_less_load_over_prefill"] = prefill_s / (secs["end_to_end"] - load_s)
    row |= {"store_bytes_per_token": store_bytes / n, "writer": ex.writer, "compressor": ex.compressor}
    row["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    path = Path(os.environ.get("OUT") or ".") / f"{a.name}.json"
    res = json.loads(path.read_text()) if path.is_file() else {}
    res.update(bench_json.header(a.name))
    res.setdefault(a.key, {})[backend] = row
    bench_json.write(res, a.name)
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
