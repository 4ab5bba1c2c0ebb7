"""The end of a training run: final/ with train_summary.json, the plots, the ranks torn down together."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from omegaconf import OmegaConf

from pipeline import __version__, ranks
from pipeline.config_choices import Strategy
from pipeline.formats import train_summary
from pipeline.models import fsdp
from pipeline.training.checkpoints import selected
from pipeline.training.session import Plan, Session

log = logging.getLogger(__name__)


def end(s: Session) -> None:
    """Tear the ranks down together. Every rank waits for rank 0's final save, then drops its DDP model (the
    Reducer holds the gloo process group: released after a peer has exited, its destructor joined a worker
    that waited on that peer for ever: 3 of 8 two-rank resumes on a loaded 2-core machine, test_ranks), then
    the
    process group goes."""
    import gc

    acc = s.accelerator
    acc.wait_for_everyone()
    s.model = s.optimizer = s.scheduler = s.trainable = s.probe = None
    acc.free_memory()
    gc.collect()
    acc.wait_for_everyone()
    acc.end_training()


def finish(
    accelerator, model, cfg, root: Path, step: int, final_val: dict, upstream: dict, plan: Plan
) -> None:
    accelerator.wait_for_everyone()
    sharded = cfg.train.strategy == Strategy.fsdp
    full = (
        fsdp.full_state_dict(model) if sharded else None
    )  # a collective: every rank gathers, rank 0 keeps it
    if not accelerator.is_main_process:
        return
    final = root / "final"
    accelerator.unwrap_model(model).save_pretrained(str(final), **({"state_dict": full} if sharded else {}))
    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    first_val = next(r for r in rows if r["split"] == "val")
    summary = {
        "produced_by": f"eaglepipe {__version__}",
        "optimizer_steps": step,
        "upstream": upstream,
        "val_before": first_val,
        "val_after": final_val,
        "val_samples": [int(i) for i in plan.val_idx],  # held out by sample; evaluate prompts from these
        "train_samples": len(plan.train_idx),
        "train_tokens": plan.train_tokens,
        "tau_probe_half": "selection",  # prompt_sets.selection_and_report: evaluate reports on the other
        "split_by_tokens_per_pack": plan.split,
        "throughput": _throughput(rows),
        "peak_memory": _peak_memory(accelerator.device),
        "world_size": accelerator.num_processes,
        "rank_layout": ranks.layout(),  # who started the ranks, nodes x ranks per node, rendezvous
        "grad_accum": cfg.train.grad_accum,
        "strategy": str(getattr(cfg.train.strategy, "value", cfg.train.strategy)),
        "selected": selected(cfg, root, step),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    train_summary.write(final, summary)
    _plot(rows, root / "plots", cfg.train.ttt_steps)
    log.info(
        "train: val full_acc_0 %.4f -> %.4f after %d steps; draft saved to %s",
        first_val["full_acc_0"],
        final_val["full_acc_0"],
        step,
        final,
    )


def _peak_memory(device) -> dict:
    """Rank 0's peak CUDA allocation over the stage since run() reset it (draft, optimizer, activations; with
    train.features=online the target replica too); {} off CUDA."""
    if device.type != "cuda":
        return {}
    return {
        "device": torch.cuda.get_device_name(device),
        "max_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "max_reserved_bytes": torch.cuda.max_memory_reserved(device),
    }


def _throughput(rows: list[dict]) -> dict:
    """Real (unpadded) tokens per second over the logged windows, all ranks together: the median and the last
    (the first window also holds compilation)."""
    rates = [r["tokens_per_s"] for r in rows if r.get("split") == "train" and "tokens_per_s" in r]
    if not rates:
        return {"windows": 0}
    return {
        "windows": len(rates),
        "tokens_per_s_median": sorted(rates)[len(rates) // 2],
        "tokens_per_s_last": rates[-1],
    }


def _plot(rows: list[dict], out: Path, ttt_steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    taus = [r for r in rows if r["split"] == "tau"]
    fig, axes = plt.subplots(1, 3 if taus else 2, figsize=(16 if taus else 11, 4))
    if taus:  # beside loss and accuracy: what serving gets (issue #17)
        for key in sorted({k for r in taus for k in r if k.startswith("k=")}, key=lambda k: int(k[2:])):
            axes[2].plot([r["step"] for r in taus], [r[key] for r in taus], "o-", label=f"tau {key}")
    for part, style in (("train", "-"), ("val", "o--")):
        pts = [r for r in rows if r["split"] == part]
        for k in range(ttt_steps):
            xs = [r["step"] for r in pts]
            axes[0].plot(xs, [r[f"loss_{k}"] for r in pts], style, label=f"{part} loss_{k}")
            axes[1].plot(xs, [r[f"full_acc_{k}"] for r in pts], style, label=f"{part} full_acc_{k}")
    for ax, title in zip(
        axes, ("loss per TTT step", "full accuracy per TTT step", "tau of the draft as exported")
    ):
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=100)
    plt.close(fig)
