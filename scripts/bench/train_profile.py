"""Benchmark (GPU): where a training step's time goes (issue #14: what binds our tokens/s).

Runs stage train through the runner as usual (any overrides) and times every micro-step from outside:
- wait_s: from the end of one micro-step to the start of the next (the DataLoader handing over a pack, logging,
  validation and checkpoints),
- step_s: inside the micro-step (host to device copy, forward, backward, optimizer), ended by a device sync,
and, for PROFILE_STEPS micro-steps after PROFILE_SKIP, a torch.profiler trace: the GPU's busy time (sum of kernel
times) against the wall time of those steps, and the top operators by device and by host time.
Usage (after prepare/extract/vocab in RUN_DIR):
  python scripts/bench/train_profile.py +experiment=gpu_smollm2 run_dir=RUN_DIR train.max_steps=60 ...
Writes train_profile.json (and train_profile.txt, the operator tables) to $OUT, or to the run dir.
"""

import json
import os
import socket
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from pipeline.config import register  # noqa: E402
from pipeline.runner import run_stages  # noqa: E402
from pipeline.stages import train  # noqa: E402

SKIP = int(os.environ.get("PROFILE_SKIP", "20"))
STEPS = int(os.environ.get("PROFILE_STEPS", "10"))


def _busy_us(events) -> float:
    """Microseconds in which at least one kernel ran on the device (the union of kernel intervals)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


def main(overrides: list[str]) -> None:
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["train.wandb.mode=disabled", "stage=train", *overrides])
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    inner, calls, times = train._micro_step, [0], {"wait": [], "step": []}
    last_end = [None]
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                  + ([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []))
    window = {}

    def timed(t, s, batch):
        n = calls[0]
        if n == SKIP:
            sync()
            prof.start()
            window["t0"] = time.perf_counter()
        t0 = time.perf_counter()
        if last_end[0] is not None:
            times["wait"].append(t0 - last_end[0])
        out = inner(t, s, batch)
        sync()
        end = time.perf_counter()
        times["step"].append(end - t0)
        last_end[0] = end
        calls[0] += 1
        if n == SKIP + STEPS - 1:
            window["wall_s"] = end - window["t0"]
            prof.stop()
        return out

    train._micro_step = timed
    t_all = time.perf_counter()
    try:
        run_stages(cfg)
    finally:
        if "t0" in window and "wall_s" not in window:  # the run ended inside the profiled window
            sync()
            window["wall_s"] = time.perf_counter() - window["t0"]
            prof.stop()
    total = time.perf_counter() - t_all
    res = {"bench": "train_profile", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "host": socket.gethostname(), "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "command": "python scripts/bench/train_profile.py " + " ".join(overrides),
           "micro_steps": calls[0], "stage_wall_s": round(total, 2)}
    for k, v in times.items():
        v = v[SKIP - (k == "wait"):] if SKIP else v  # after compilation and warm-up (wait i precedes step i + 1)
        res[f"{k}_s_mean"] = sum(v) / max(len(v), 1)
        res[f"{k}_s_total"] = sum(v)
    res["step_fraction"] = res["step_s_total"] / max(res["step_s_total"] + res["wait_s_total"], 1e-9)
    tables = ""
    if "wall_s" in window:
        events = prof.key_averages()
        dev_us = _busy_us(prof.events())
        res["profiled_steps"] = min(STEPS, calls[0] - SKIP)
        res["profiled_wall_s"] = window["wall_s"]
        res["gpu_busy_s"] = dev_us / 1e6
        res["gpu_busy_fraction"] = res["gpu_busy_s"] / window["wall_s"]
        res["host_ops"] = sum(e.count for e in events)
        tables = (events.table(sort_by="self_device_time_total", row_limit=25) + "\n\n"
                  + events.table(sort_by="self_cpu_time_total", row_limit=25))
    out = Path(os.environ.get("OUT") or cfg.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_profile.json").write_text(json.dumps(res, indent=1))
    (out / "train_profile.txt").write_text(tables)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
