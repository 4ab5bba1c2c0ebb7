"""Benchmark: the offline bench's batched greedy-chain speculation vs its serial reference (#14, item 3).

Same export, same prompts, same device, fp32 (as stage evaluate runs): for each draft length k, every prompt
through `offline.speculate` one at a time, then all of them through `batched.speculate` in batches of
eval.batch_size; then every k at once (`batched.by_k`: batch_size x max_draft rows per pass, what stage
evaluate runs); wall times, tau of each, and whether every row's tokens and accepted counts are identical.
Usage (an exported run dir and the overrides that made it; scripts/gpu/plans/perf.json runs it):
  python scripts/bench/evaluate_batched.py +experiment=gpu_smollm2 run_dir=/tmp/gpurun cache_dir=/tmp/epc \
      eval.num_prompts=32 eval.max_new_tokens=64 eval.max_draft=5 eval.batch_size=32
Writes evaluate_batched.json (bench_json: $OUT, else the run dir).
"""

import json
import sys
import time
from pathlib import Path

import bench_json
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from pipeline.acceptance import batched, offline  # noqa: E402
from pipeline.acceptance.prompts import heldout_prompts  # noqa: E402
from pipeline.capture.hf import Capture  # noqa: E402
from pipeline.config import register  # noqa: E402
from pipeline.formats.run_dir import RunDir  # noqa: E402
from pipeline.models import targets  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def tau(rows) -> float:
    rounds = [r for _, rs in rows for r in rs]
    return sum(r + 1 for r in rounds) / max(len(rounds), 1)


def main() -> None:
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=sys.argv[1:])
    e = cfg.eval
    store = RunDir.of(cfg).open_features()
    folder = Path(store.facts["target_path"])
    tok = targets.load_tokenizer(folder, cfg.target)
    device, _ = targets.pick_device_dtype(e.device, "fp32")
    model = targets.load_model(folder, cfg.target, device, torch.float32, "sdpa")
    capture = Capture(model, store.aux_layer_ids)
    export = RunDir.of(cfg).export("sglang")
    dr = offline.ExportedDraft(
        load_file(str(export / "model.safetensors")),
        json.loads((export / "config.json").read_text()),
        model.get_input_embeddings().weight.detach(),
        device,
    )
    prompts = heldout_prompts(cfg, store, e.num_prompts, e.prompt_tokens)
    n, eos, bs = e.max_new_tokens, tok.eos_token_id, e.batch_size
    chunks = [prompts[i : i + bs] for i in range(0, len(prompts), bs)]
    batched.speculate(model, capture, dr, prompts[:2], 4, 2, eos)  # warm-up (kernels, allocator)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    result = bench_json.header("evaluate_batched", device=name, prompts=len(prompts), max_new_tokens=n)
    result |= {"batch_size": bs, "per_k": {}}
    serial_total = batched_total = 0.0
    serial_rows = {}
    for k in range(1, e.max_draft + 1):
        sync(device)
        t0 = time.perf_counter()
        serial = [offline.speculate(model, capture, dr, p, n, k, eos) for p in prompts]
        sync(device)
        t1 = time.perf_counter()
        rows = [r for c in chunks for r in batched.speculate(model, capture, dr, c, n, k, eos)]
        sync(device)
        t2 = time.perf_counter()
        same = [tuple(s) == tuple(b) for s, b in zip(serial, rows)]
        serial_rows[k] = serial
        r = {"serial_s": round(t1 - t0, 3), "batched_s": round(t2 - t1, 3), "tau_serial": tau(serial)}
        result["per_k"][str(k)] = r | {
            "tau_batched": tau(rows),
            "rows_identical": sum(same),
            "rows": len(same),
        }
        serial_total += t1 - t0
        batched_total += t2 - t1
        print(
            f"k={k}: serial {t1 - t0:.1f} s, batched {t2 - t1:.1f} s, tau {tau(serial):.4f} / "
            f"{tau(rows):.4f}, identical rows {sum(same)}/{len(same)}",
            flush=True,
        )
    # what stage evaluate runs: every k of a chunk in one pass (batch_size x max_draft rows, batched.by_k)
    ks = list(range(1, e.max_draft + 1))
    sync(device)
    t0 = time.perf_counter()
    together = batched.by_k(model, capture, dr, prompts, n, ks, eos, bs)
    sync(device)
    together_s = time.perf_counter() - t0
    same_all = sum(tuple(s) == tuple(b) for k in ks for s, b in zip(serial_rows[k], together[k]))
    r = {"batched_s": round(together_s, 3), "rows": bs * len(ks), "rows_identical": same_all}
    r |= {"rows_total": len(prompts) * len(ks), "tau": {str(k): tau(together[k]) for k in ks}}
    result["all_k_in_one_pass"] = r
    result |= {"serial_s": round(serial_total, 2), "batched_one_k_per_pass_s": round(batched_total, 2)}
    result |= {"batched_s": round(together_s, 2), "speedup": round(serial_total / together_s, 2)}
    result["speedup_one_k_per_pass"] = round(serial_total / batched_total, 2)
    taus = [
        (r["tau_serial"], r["tau_batched"], result["all_k_in_one_pass"]["tau"][k])
        for k, r in result["per_k"].items()
    ]
    result["tau_equal"] = all(a == b == c for a, b, c in taus)
    bench_json.write(result, "evaluate_batched", RunDir.of(cfg).root)
    print(
        json.dumps({k: result[k] for k in ("serial_s", "batched_one_k_per_pass_s", "batched_s", "tau_equal")})
    )


if __name__ == "__main__":
    main()
