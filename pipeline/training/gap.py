"""Issue #47 item 1: why training's validation accuracy is not what evaluate measures, one step at a time.

On a finished run (train, export and evaluate done), over its held-out (validation) samples, step-0 accuracy:
  A  speculators' full_acc_0 as validate logs it (packed; vs the target's argmax over the DRAFT vocabulary;
     every supervised position)                                          <- what training reports
  A1 the same forward, one sample per pack (packing: does attention stay inside each sample?)
  B  the training forward's proposal through d2t vs the token the target wrote, every answer position
  C  B at evaluate's positions only (the first eval.max_new_tokens tokens of each answer)
  D  C through the exported draft (bf16 export, the engines' forward) on the store's hidden states
  E  D on hidden states recomputed as evaluate computes them (fp32 target); |delta| per aux layer
  F  E along the target's own fp32 greedy continuation of the same prompt (what evaluate does)
  G  evaluate's reported teacher-forced acc_0 (report half of the held-out prompts)
Usage: python scripts/bench/gap_ablation.py RUN_DIR [NAME] [--samples N]   (writes NAME.json; BENCHMARKS.md,
Quality)
"""

import argparse
import json
from pathlib import Path

import torch
from omegaconf import OmegaConf

from pipeline import intervals
from pipeline.acceptance import batched
from pipeline.acceptance.draft_model import ExportedDraft
from pipeline.acceptance.offline import _target
from pipeline.data import prompt_sets
from pipeline.data.features_dataset import collate, plan_packs
from pipeline.formats import (
    bench_results,
    vocab_map,
)
from pipeline.formats import export_layouts as lay
from pipeline.formats.feature_store import FeatureStore
from pipeline.models import draft, losses, targets
from pipeline.training.positions import answer_index, pack_metrics, ratios


def rate(hits: list[torch.Tensor]) -> dict:
    """Pooled accuracy over prompts, with its 95 % bootstrap interval over prompts (as evaluate's)."""
    h = torch.cat(hits) if hits else torch.zeros(0, dtype=torch.bool)
    ci = intervals.ratio_ci95([(int(r.sum()), len(r)) for r in hits if len(r)]) if hits else None
    return {
        "acc": float(h.float().mean()) if len(h) else None,
        "ci95": ci,
        "positions": len(h),
        "prompts": len(hits),
    }


def training_forward(cfg, run: Path, store, val: list[int]) -> dict:
    """A, A1, B, C: the trained draft (train/final) in speculators' own forward over the val samples."""
    from safetensors.torch import load_file

    folder = Path(store.facts["target_path"])
    d2t, t2d, _ = vocab_map.load(run / "vocab")
    hf = targets.load_config(folder, cfg.target)
    model = draft.build(folder, hf, store.aux_layer_ids, d2t, t2d, cfg.train.ttt_steps, "sdpa")
    state = load_file(str(run / "train" / "final" / "model.safetensors"))
    # on the GPU as training ran (speculators compiles its forward where CUDA is; CPU inputs to it fail)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    missing = set(model.load_state_dict(state, strict=False).missing_keys) - {"t2d", "d2t"}
    missing = {k for k in missing if "verifier" not in k and "embed_tokens" not in k}
    assert not missing, f"trained weights not loaded: {sorted(missing)[:5]}"
    model.to(dev).eval()
    d2t = d2t.to(dev)
    loss = losses.loss_config(cfg.train.loss, cfg.train.loss_chunk_tokens)
    lengths, tpp = store.sample_lengths(), cfg.train.tokens_per_pack
    arms = {
        "packed": plan_packs(torch.tensor(val).numpy(), lengths, tpp, cfg.seed, 0, shuffle=False),
        "one_per_row": [[(i, 0, 0)] for i in val if lengths[i] - 1 <= tpp],
    }
    fwd = {"ttt_steps": cfg.train.ttt_steps, "loss_config": loss}
    out = {}
    for name, packs in arms.items():
        sums: dict = {}
        for pack in packs:
            b = {k: v.to(dev) for k, v in collate(store, pack, tpp, with_answer_index=True).items()}
            for k in ("hidden_states", "verifier_last_hidden_states"):
                b[k] = b[k].float()
            with torch.no_grad():
                m = pack_metrics(model, b, fwd, d2t, cfg.eval.max_new_tokens)
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        out[name] = {
            "full_acc_0": sums["full_acc_0_sum"] / sums["full_acc_0_total"],
            **ratios(sums),
            "positions": sums["full_acc_0_total"],
            "eval_positions": sums["evalpos_token_acc_0_total"],
            "packs": len(packs),
        }
    return out


def exported_forward(cfg, run: Path, store, val: list[int]) -> dict:
    """D, E, F: the exported draft on store states, on evaluate's recomputed states, and along the target's
    own fp32 greedy continuation."""
    tensors, config = lay.read_sglang(run / "export" / "sglang")
    folder, tok, device, model, capture = _target(cfg, store)
    dr = ExportedDraft(tensors, config, model.get_input_embeddings().weight.detach(), device)
    K = cfg.eval.max_new_tokens
    hits = {"D_store_states": [], "E_recomputed_states": [], "F_greedy_continuation": []}
    delta = {k: {"max": 0.0, "sum": 0.0, "n": 0, "scale": 0.0} for k in store.aux_layer_ids}
    prompts, same_prefix, used = [], [], []

    def hits_along(seq, aux, mask):
        aux = aux.to(device)
        out = dr.layer(
            torch.tensor(seq[1:], device=device), dr.fuse(aux[:-1]), torch.arange(1, len(seq), device=device)
        )
        prop = dr.next_target_ids(out[:-1]).cpu()  # predicts seq[2:]
        nxt = torch.tensor(seq[2:])
        m = torch.tensor(mask)
        j = answer_index(m)[1:-1]  # index of seq[j+1] in its answer
        scored = m[1:-1].bool() & m[2:].bool() & (j >= 0) & (j <= K - 2)
        return (prop == nxt)[scored]

    for i in val:
        s = store.sample(i)
        seq, mask = s["input_ids"].tolist(), s["loss_mask"].tolist()
        if 1 not in mask:
            continue
        P = mask.index(1)
        hits["D_store_states"].append(hits_along(seq, s["aux_hidden"].float(), mask))
        with torch.no_grad():
            model(input_ids=torch.tensor([seq], device=device))
        aux = capture.states()[0][0].float().cpu()
        hits["E_recomputed_states"].append(hits_along(seq, aux, mask))
        H = aux.shape[1] // len(store.aux_layer_ids)
        for n, k in enumerate(store.aux_layer_ids):
            d = (aux[:, n * H : (n + 1) * H] - s["aux_hidden"][:, n * H : (n + 1) * H].float()).abs()
            delta[k]["max"] = max(delta[k]["max"], float(d.max()))
            delta[k]["sum"], delta[k]["n"] = delta[k]["sum"] + float(d.sum()), delta[k]["n"] + d.numel()
            delta[k]["scale"] += float(aux[:, n * H : (n + 1) * H].abs().sum())
        prompts.append((seq[:P], seq[P:]))
        used.append(i)
    greedy = []
    for a in range(0, len(prompts), 16):
        chunk = [p for p, _ in prompts[a : a + 16]]
        greedy += batched.greedy(model, capture, chunk, K, tok.eos_token_id)
    report = set(prompt_sets.selection_and_report(val)[1][: cfg.eval.num_prompts])
    hits["F_report_half"] = []
    for i, (prompt, answer), g in zip(used, prompts, greedy):
        if len(g) < 2:
            continue
        seq = prompt + g
        with torch.no_grad():
            model(input_ids=torch.tensor([seq], device=device))
        mask = [0] * len(prompt) + [1] * len(g)
        hits["F_greedy_continuation"].append(hits_along(seq, capture.states()[0][0].float(), mask))
        if i in report:
            hits["F_report_half"].append(hits["F_greedy_continuation"][-1])
        n = min(len(g), len(answer))
        same_prefix.append(next((t for t in range(n) if g[t] != answer[t]), n) / max(1, min(len(g), K)))
    return {
        **{k: rate(v) for k, v in hits.items()},
        "aux_delta": {
            str(k): {
                "max": v["max"],
                "mean": v["sum"] / max(v["n"], 1),
                "rel_mean": v["sum"] / max(v["scale"], 1e-9),
            }
            for k, v in delta.items()
        },
        "greedy_equals_stored_answer_prefix": sum(same_prefix) / max(len(same_prefix), 1),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("name", nargs="?", default="gap_ablation_cpu")
    ap.add_argument("--samples", type=int, default=0, help="first N validation samples (0: all)")
    a = ap.parse_args(argv)
    run = a.run_dir
    summary = json.loads((run / "train" / "final" / "train_summary.json").read_text())
    cfg = OmegaConf.create(summary["config"])
    store = FeatureStore(run / "features")
    val = summary["val_samples"][: a.samples or None]
    res = bench_results.header(
        a.name, run_dir=str(run), val_samples=len(val), eval_max_new_tokens=cfg.eval.max_new_tokens
    )
    res["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    res["A_logged_val"] = {
        k: summary["val_after"].get(k)
        for k in ("full_acc_0", "evalpos_full_acc_0", "token_acc_0", "evalpos_token_acc_0")
    }
    res["training_forward"] = training_forward(cfg, run, store, val)
    res["exported_forward"] = exported_forward(cfg, run, store, val)
    sets = (
        json.loads((run / "eval" / "sets.json").read_text()) if (run / "eval" / "sets.json").is_file() else {}
    )
    acc = json.loads((run / "eval" / "acceptance.json").read_text())
    res["G_evaluate_reported"] = {
        "heldout": acc["teacher_forced_acc_0"]["trained"],
        **{
            k: (v.get("teacher_forced_acc_0") or {}).get("trained") for k, v in sets.items() if k != "heldout"
        },
    }
    out = bench_results.write(
        res, a.name, Path(__file__).resolve().parents[2] / "scripts" / "bench" / "results"
    )
    t, e = res["training_forward"], res["exported_forward"]
    rows = [
        (
            "A  logged val full_acc_0 (packed, draft-vocab argmax, all positions)",
            res["A_logged_val"]["full_acc_0"],
        ),
        ("A' same, recomputed here (packed)", t["packed"]["full_acc_0"]),
        ("A1 one sample per pack", t["one_per_row"]["full_acc_0"]),
        ("A2 A at evaluate's positions", t["packed"]["evalpos_full_acc_0"]),
        ("B  vs the token written, via d2t, all positions", t["packed"]["token_acc_0"]),
        ("C  B at evaluate's positions", t["packed"]["evalpos_token_acc_0"]),
        ("D  exported draft, store states, eval positions", e["D_store_states"]["acc"]),
        ("E  exported draft, recomputed fp32 states", e["E_recomputed_states"]["acc"]),
        ("F  along the target's fp32 greedy continuation", e["F_greedy_continuation"]["acc"]),
        ("F' F on the report half's prompts evaluate uses", e["F_report_half"]["acc"]),
        ("G  evaluate's reported teacher-forced acc_0 (heldout)", res["G_evaluate_reported"]["heldout"]),
    ]
    for name, v in rows:
        print(f"{name:<72} {v if v is None else round(v, 4)}")
    print("F' 95% CI over prompts:", e["F_report_half"]["ci95"], " F:", e["F_greedy_continuation"]["ci95"])
    print("aux |delta| (store vs recomputed):", json.dumps(e["aux_delta"]), "->", out)
