"""Issue #47, causes (c) and (d) of the gap between training's val full_acc_0 and evaluate's teacher-forced
acc_0, measured on one run dir (prepare + extract done; train + export add the draft-level rows).

(c) the feature store's states vs evaluate's fp32 Capture of the same token ids, per aux layer and last;
    the layer ids (hook k = HF hidden_states[k+1]); the store vs a bf16 target (extract's dtype=auto on GPU).
(d) prompt ids as trained (the store's prefix before each answer), as evaluate renders them
    (apply_chat_template(add_generation_prompt=True)) and as SGLang's /v1/chat/completions does (its own
    OpenAIServingChat._apply_jinja_template, run in .venv-engines without a server); which positions training
    scores vs evaluate's teacher_forced.

  .venv/bin/python scripts/bench/gap_skews.py --run-dir /tmp/gapskew/run --samples 6 --prompts 20 \
      --out scripts/bench/results/gap_skews_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def sglang_worker(inp: str, out: str) -> None:
    """In .venv-engines: SGLang's chat-completions rendering of each message list, by its own code."""
    import types
    from collections import OrderedDict

    sys.path.insert(0, str(REPO))
    from pipeline.engines import shims

    shims.install()
    sys.modules.setdefault("jsonschema", shims._module("jsonschema"))  # only validates tools; none sent
    from sglang.srt.entrypoints.openai import chat_encoding
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
    from sglang.srt.parser.template_manager import TemplateManager
    from sglang.srt.utils.hf_transformers.tokenizer import get_tokenizer
    from transformers import AutoConfig

    job = json.loads(Path(inp).read_text())
    tok, hf = get_tokenizer(job["folder"]), AutoConfig.from_pretrained(job["folder"])
    stub = types.SimpleNamespace(
        tokenizer=tok, processor=None, model_config=types.SimpleNamespace(hf_config=hf)
    )
    tm = TemplateManager()
    tm.load_chat_template(stub, None, job["folder"])  # launch_line passes no --chat-template
    s = object.__new__(OpenAIServingChat)  # the fields _apply_jinja_template reads, set as __init__ sets them
    s.tokenizer_manager, s.template_manager, s.is_minimax_m3, s.tool_call_parser = stub, tm, False, None
    s.chat_encoding_spec = chat_encoding.resolve_chat_encoding_spec(hf_config=hf, tokenizer=tok)
    s._encoding_adapter, s.default_chat_template_kwargs, s._chat_template_cache = None, {}, OrderedDict()
    s._tokenizer_auto_adds_specials = len(tok.encode("")) > 0
    s._prompt_text_round_trip_is_lossy = s._probe_prompt_text_round_trip()
    ids = [
        list(s._apply_jinja_template(ChatCompletionRequest(model="m", messages=m), None, False).prompt_ids)
        for m in job["messages"]
    ]
    how = {"conversation_template": tm.chat_template_name, "python_template": str(tm.python_chat_template)}
    how |= {"encoding_spec": s.chat_encoding_spec, "round_trip_lossy": s._prompt_text_round_trip_is_lossy}
    Path(out).write_text(json.dumps({"ids": ids, "how": how, "sglang": __import__("sglang").__version__}))


def stats(rows: dict, name: str, a, b) -> None:
    r = rows.setdefault(name, {"max_abs": 0.0, "sum_abs": 0.0, "sum_x": 0.0, "n": 0, "equal": 0})
    d = (a.float() - b.float()).abs()
    r["max_abs"] = max(r["max_abs"], float(d.max()))
    r["sum_abs"] += float(d.sum())
    r["sum_x"] += float(b.float().abs().sum())
    r["n"], r["equal"] = r["n"] + d.numel(), r["equal"] + int((d == 0).sum())


def finish(rows: dict) -> dict:  # max |d|, mean |d|, mean |d| / mean |x|, fraction bitwise equal
    f = lambda r: [r["max_abs"], r["sum_abs"] / r["n"], r["sum_abs"] / r["sum_x"], r["equal"] / r["n"]]  # noqa: E731
    return {
        k: dict(zip(("max_abs", "mean_abs", "rel_mean", "equal_fraction"), f(r))) for k, r in rows.items()
    }


def cause_c(cfg, run: Path, store, tok, samples: list[int], val: set) -> dict:
    import torch

    from pipeline.capture.hf import Capture
    from pipeline.models import targets

    folder, ids_aux = Path(store.facts["target_path"]), store.aux_layer_ids
    m32 = targets.load_model(folder, cfg.target, torch.device("cpu"), torch.float32, "sdpa")
    m16 = targets.load_model(folder, cfg.target, torch.device("cpu"), torch.bfloat16, "sdpa")
    c32, c16, H = Capture(m32, ids_aux), Capture(m16, ids_aux), store.hidden_size
    dr, acc = None, {}
    if (run / "export/sglang/config.json").is_file():
        from pipeline.acceptance.draft_model import ExportedDraft
        from pipeline.formats import export_layouts as lay

        t, conf = lay.read_sglang(run / "export/sglang")
        dr = ExportedDraft(t, conf, m32.get_input_embeddings().weight.detach(), "cpu")
        acc["export_aux_layer_ids"] = conf.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    rows, ident, eot_next = {}, {}, {}
    with torch.no_grad():
        for i in samples:
            s = store.sample(i)
            x = s["input_ids"][None]
            out = m32(input_ids=x, output_hidden_states=True)
            (aux_e, last_e), hs = (t[0] for t in c32.states()), out.hidden_states
            m16(input_ids=x)
            aux_b, last_b = (t[0] for t in c16.states())
            for j, k in enumerate(ids_aux):
                cut = slice(j * H, (j + 1) * H)
                stats(rows, f"store_vs_eval/aux{k}", s["aux_hidden"][:, cut], aux_e[:, cut])
                stats(rows, f"store_vs_bf16target/aux{k}", s["aux_hidden"][:, cut], aux_b[:, cut])
                stats(ident, f"hook{k}_vs_hf_hidden_states[{k + 1}]", aux_e[:, cut], hs[k + 1][0].bfloat16())
                stats(ident, f"hook{k}_vs_hf_hidden_states[{k}]", aux_e[:, cut], hs[k][0].bfloat16())
            stats(rows, "store_vs_eval/last_prenorm", s["last_hidden"], last_e)
            stats(rows, "store_vs_bf16target/last_prenorm", s["last_hidden"], last_b)
            stats(ident, "store_last_vs_hf_hidden_states[-1](post-norm)", s["last_hidden"], hs[-1][0])
            normed = m32.model.norm(s["last_hidden"].float()[None])[0]
            stats(ident, "norm(store_last)_vs_hf_hidden_states[-1]", normed, hs[-1][0])
            if dr is None or i not in val:
                continue
            n, tgt = x.shape[1], out.logits[0, 1:].argmax(-1)  # position t predicts the target's id t+2
            scored, after = s["loss_mask"][1:].bool(), x[0, 1:] == tok.eos_token_id
            for t in tgt[scored & after].tolist():
                eot_next[t] = eot_next.get(t, 0) + 1
            for name, aux in (("store_aux", s["aux_hidden"]), ("eval_aux", aux_e), ("bf16_aux", aux_b)):
                hit = dr.next_target_ids(dr.layer(x[0, 1:], dr.fuse(aux[:-1]), torch.arange(1, n))) == tgt
                for part, sel in {
                    "scored": scored,
                    "not_after_eot": scored & ~after,
                    "after_eot": scored & after,
                }.items():
                    r = acc.setdefault(f"{name}/{part}", {"hits": 0, "positions": 0})
                    r["hits"] += int(hit[sel].sum())
                    r["positions"] += int(sel.sum())
                    r["acc_0"] = r["hits"] / max(r["positions"], 1)
    acc["target_argmax_after_eot"] = {repr(tok.decode([t])): n for t, n in eot_next.items()}
    hooks = {"aux_ids": c32.aux_ids, "last_id": c32.last_id}
    facts = {k: store.facts.get(k) for k in ("compute_dtype", "logical_dtype", "last_hidden")}
    out = {"store_aux_layer_ids": ids_aux, "capture_hooks": hooks, "store_facts": facts, "samples": samples}
    return out | {"diffs": finish(rows), "layer_identity": finish(ident), "draft_acc_0_val": acc}


def first_diff(tok, a: list[int], b: list[int]):
    p = next((p for p, (u, v) in enumerate(zip(a, b)) if u != v), None)
    p = p if p is not None or len(a) == len(b) else min(len(a), len(b))
    w = slice(max((p or 0) - 2, 0), (p or 0) + 3)
    return "identical" if p is None else {"at": p, "ours": tok.decode(a[w]), "theirs": tok.decode(b[w])}


def cause_d(cfg, run: Path, store, tok, order: list[int], val: set, want: int) -> dict:
    from pipeline.data import mixture, prompt_sets
    from pipeline.data.chat_tokens import cut_turns, tokenize_all

    convs, _ = mixture.load_conversations(cfg.data)
    cut_turns(convs, cfg.prepare.max_assistant_turns)
    rows, *_ = tokenize_all(tok, convs, cfg.prepare.max_len)
    by_src = {c["source_id"]: c for c in convs}
    same_store = sum(rows["input_ids"][i] == store.tokens(i)["input_ids"].tolist() for i in order)
    keys = ("samples", "scored", "after_eot", "answer_starts")
    items, align = [], {g: dict.fromkeys(keys, 0) for g in ("val", "all")}
    for sid in order:
        t = store.tokens(sid)
        ids, mask = t["input_ids"].tolist(), t["loss_mask"].tolist()
        starts = [p for p in range(1, len(ids)) if mask[p] and not mask[p - 1]]
        for g in ("val", "all") if sid in val else ("all",):  # shifted position t is scored iff l[t+1]
            eot = sum(m and x == tok.eos_token_id for x, m in zip(ids[1:], mask[1:]))
            for key, v in zip(keys, (1, sum(mask[1:]), eot, len(starts))):
                align[g][key] += v
        msgs = by_src[rows["source_id"][sid]]["messages"]
        turns = [a for a, m in enumerate(msgs) if m["role"] == "assistant"][: len(starts)]
        first = prompt_sets.before_answer(store, [sid], 1, 10**9) == [ids[: starts[0]]] if starts else None
        for k, a in enumerate(turns[: max(want - len(items), 0)]):
            h = tok.apply_chat_template(
                msgs[:a], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            it = {"sample": sid, "turn": k, "msgs": msgs[:a], "ours": ids[: starts[k]], "evaluate": list(h)}
            items.append(it | {"heldout_prefix_is_store_prefix": first if k == 0 else None})
    with tempfile.TemporaryDirectory() as tmp:
        job, res = Path(tmp) / "in.json", Path(tmp) / "out.json"
        msgs = [it.pop("msgs") for it in items]
        job.write_text(json.dumps({"folder": store.facts["target_path"], "messages": msgs}))
        engines = str(REPO / ".venv-engines/bin/python")
        subprocess.run([engines, __file__, "--sglang-worker", str(job), str(res)], check=True)
        sg = json.loads(res.read_text())
    for it, s in zip(items, sg["ids"]):
        it["trained_vs_evaluate"] = first_diff(tok, it["ours"], it.pop("evaluate"))
        it["trained_vs_sglang"] = first_diff(tok, it["ours"], s)
        it["trained"] = {"tokens": len(it["ours"]), "tail": tok.decode(it.pop("ours")[-6:])}
    return {"prompts": items, "sglang_rendering": sg["how"], "sglang_version": sg["sglang"],
            "rows_rebuilt_equal_store": f"{same_store}/{len(order)}", "alignment": align}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", type=Path, help="a run dir with prepare + extract done (required)")
    ap.add_argument("--samples", type=int, default=6, help="store samples for (c), held-out first")
    ap.add_argument("--prompts", type=int, default=60, help="prompts for (d), held-out first")
    ap.add_argument("--out", type=Path, default=REPO / "scripts/bench/results/gap_skews_cpu.json")
    ap.add_argument("--sglang-worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.sglang_worker:
        return sglang_worker(*args.sglang_worker)
    if args.run_dir is None:
        ap.error("--run-dir is required")
    sys.path.insert(0, str(REPO))
    from omegaconf import OmegaConf

    from pipeline.data.features_dataset import split
    from pipeline.data.prompt_sets import selection_and_report
    from pipeline.formats import prepared, train_summary
    from pipeline.formats.feature_store import FeatureStore
    from pipeline.models import targets

    run = args.run_dir.resolve()
    cfg = OmegaConf.load(run / ".hydra/config.yaml")
    store = FeatureStore(run / "features")
    tok = targets.load_tokenizer(Path(store.facts["target_path"]), cfg.target)
    facts = train_summary.read(run / "train/final") or {}
    val = facts.get("val_samples")
    if val is None:  # no training yet: the split train would make
        n = len(store.sample_lengths())
        val = split(n, cfg.train.val_fraction, cfg.seed, prepared.heldout_samples(run))[1].tolist()
    sel, rep = selection_and_report(val)
    order = rep + sel + [i for i in range(len(store.sample_lengths())) if i not in set(val)]

    def git(*a):
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True).stdout.strip()

    report = {
        "machine": {"host": platform.node(), "cpu": platform.processor(), "cores": os.cpu_count()},
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty_paths": git("status", "--porcelain").splitlines(),
        "command": " ".join(sys.argv),
        "run_dir": str(run),
        "val_samples": {"report_half": rep, "selection_half": sel},
        "training_val_full_acc_0": (facts.get("val_after") or {}).get("full_acc_0"),
        "d_prompt_ids": cause_d(cfg, run, store, tok, order, set(val), args.prompts),
        "c_hidden_states": cause_c(cfg, run, store, tok, order[: args.samples], set(val)),
    }
    c, d = report["c_hidden_states"], report["d_prompt_ids"]
    print(f"(c) samples {c['samples']}; columns: max|d|, mean|d|, mean|d|/mean|x|, fraction equal")
    for k, r in [*c["diffs"].items(), *c["layer_identity"].items()]:
        print(f"  {k:<50}" + "".join(f"{v:>11.4g}" for v in r.values()))
    for k, r in c["draft_acc_0_val"].items():
        print(f"  draft on val, {k:<36} {r}")
    print(f"(d) SGLang renders with {d['sglang_rendering']}; scored positions {d['alignment']}")
    for it in d["prompts"]:
        head = f"  sample {it['sample']:>3} turn {it['turn']:>2} ({it['trained']['tokens']:>3} tokens)"
        print(f"{head}: vs evaluate {it['trained_vs_evaluate']}; vs SGLang {it['trained_vs_sglang']}; "
              f"heldout prefix = store prefix: {it['heldout_prefix_is_store_prefix']}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
