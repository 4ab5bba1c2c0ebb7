"""Benchmark: capture throughput of `extract` (tokens/s written to the store) beside plain prefill.

Same prepared samples, same length-bucketed batches, same model and dtype, three measurements:
  prefill   - the decoder forward alone (no hooks, nothing copied back)
  capture   - forward + hooks + bf16 cast + copy to host (what extract does before writing)
  extract   - the real stage end to end, writing the zarr store (per compressor; the default compressor with
              extract.write_workers 2, 4 and 8: writer processes encoding and writing each shard's chunks)
Usage (GPU):  python scripts/bench/extract_throughput.py cache_dir=/tmp/epcache run_dir=/tmp/bench data.limit=null
Prints a table last and writes bench_extract.json to $OUT (or the run dir).
"""

import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from pipeline.stages import extract, prepare  # noqa: E402
from pipeline.models import targets  # noqa: E402
from pipeline.engines import hf_capture  # noqa: E402
from pipeline.formats import prepared  # noqa: E402
from pipeline.config import register  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def batches(cfg, ds, lengths):
    for spec in extract.plan_shards(lengths, cfg.extract.shard_tokens):
        for b in extract.plan_batches(spec.lengths, cfg.extract.batch_tokens, cfg.extract.max_batch_size):
            yield hf_capture.pad_batch([ds[spec.sample_start + i] for i in b])


def timed(fn, device) -> float:
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def main(overrides):
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    t_prep = timed(lambda: prepare.run(cfg), torch.device("cpu"))
    ds, stats = prepared.load(cfg.run_dir)
    ids_all = ds["input_ids"]
    lengths = np.array([len(x) for x in ids_all])
    device, dtype = targets.pick_device_dtype(cfg.extract.device, cfg.extract.dtype)
    folder = targets.resolve(cfg.target, cfg.cache_dir)
    model = targets.load_model(folder, cfg.target, device, dtype, cfg.extract.attn_implementation)
    aux = hf_capture.aux_layer_ids(cfg.extract.aux_layers, model.config.num_hidden_layers)
    pinned = [(i.to(device), a.to(device)) for i, a in batches(cfg, ids_all, lengths)]  # inputs on device first
    base = model.get_decoder()

    def prefill():
        with torch.inference_mode():
            for i, a in pinned:
                base(input_ids=i, attention_mask=a, use_cache=False)

    cap = hf_capture.Capture(model, aux)
    ns = [a.sum(1).tolist() for _, a in pinned]

    def capture_naive():  # the first version: the padded batch, copied synchronously into pageable memory
        for i, a in pinned:
            x, y = cap(i, a)
            x.cpu(), y.cpu()

    def capture():  # the stage's own device path: real tokens gathered on the device, async copy into pinned memory
        copied = []
        for (i, a), n in zip(pinned, ns):
            x, y = cap(i, a)
            copied = [extract._to_host(extract._valid_rows(h, n)) for h in (x, y)]
        for _, event in copied:
            if event is not None:
                event.synchronize()

    prefill()  # warm-up (kernels, allocator)
    results = {"tokens": int(lengths.sum()), "samples": len(lengths), "prepare_s": t_prep,
               "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype),
               "batch_tokens": cfg.extract.batch_tokens, "batches": len(pinned),
               "padded_tokens": int(sum(i.numel() for i, _ in pinned))}
    results["prefill_s"] = min(timed(prefill, device) for _ in range(3))
    results["capture_naive_s"] = min(timed(capture_naive, device) for _ in range(3))
    results["capture_s"] = min(timed(capture, device) for _ in range(3))
    cap.remove()
    del model, base, pinned
    phases = {}  # where the stage's time goes: the model's load, the shard loop (capture, scatter, commits)

    def timing(name, fn):
        def inner(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t
        return inner

    load_model, shards = targets.load_model, extract._extract_shards
    targets.load_model, extract._extract_shards = timing("load_model", load_model), timing("shard_loop", shards)
    # each compressor written by this process; then the default by 2, 4 and 8 writer processes (write_workers)
    runs = [(c, 1) for c in ("none", "blosc_lz4", "blosc_zstd")] + [("blosc_lz4", w) for w in (2, 4, 8)]
    for comp, workers in runs:
        cfg.extract.compressor, cfg.extract.write_workers = comp, workers
        key = comp if workers == 1 else f"{comp}_w{workers}"
        shutil.rmtree(Path(cfg.run_dir) / "features", ignore_errors=True)
        phases.clear()
        results[f"extract_{key}_s"] = timed(lambda: extract.run(cfg), device)
        results[f"extract_{key}_phases_s"] = dict(phases)
        size = sum(f.stat().st_size for f in (Path(cfg.run_dir) / "features").rglob("*") if f.is_file())
        results[f"store_{key}_bytes"] = size
    cfg.extract.write_workers = 1
    targets.load_model, extract._extract_shards = load_model, shards
    out = Path(os.environ.get("OUT") or cfg.run_dir) / "bench_extract.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    n = results["tokens"]
    print(f"\n{results['device']} {results['dtype']} | {n} tokens, {results['samples']} samples, "
          f"{results['batches']} batches (padding {results['padded_tokens'] / n - 1:.1%})")
    print(f"{'what':<22}{'seconds':>10}{'tokens/s':>14}{'store MB':>10}")
    keys = ("none", "blosc_lz4", "blosc_zstd", "blosc_lz4_w2", "blosc_lz4_w4", "blosc_lz4_w8")
    for key in ("prefill", "capture_naive", "capture", *(f"extract_{k}" for k in keys)):
        size = results.get(f"store_{key.removeprefix('extract_')}_bytes")
        print(f"{key:<22}{results[key + '_s']:>10.2f}{n / results[key + '_s']:>14,.0f}"
              f"{'' if size is None else f'{size / 1e6:>10.0f}'}")
    for comp in keys:
        print(f"extract_{comp} phases (s): " + ", ".join(f"{k} {v:.2f}" for k, v in results[f"extract_{comp}_phases_s"].items()))


if __name__ == "__main__":
    main(sys.argv[1:])
