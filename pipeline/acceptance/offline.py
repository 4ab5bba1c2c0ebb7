"""The offline bench of stage `evaluate` (no server): greedy chain speculative decoding, HF target + the
exported draft.

The draft runs through `ExportedDraft`, a small re-implementation of SGLang's Eagle3 draft forward that reads
exactly the tensors and config of run_dir/export/sglang (midlayer.*, fc, norm, lm_head, d2t; the embedding
is the target's, as SGLang shares it): a layout bug shows up as collapsed acceptance. The target runs with a
KV cache and the same aux layers captured by hooks. Reports tau = tokens per target forward (bonus token
included) and acceptance per draft position, pooled and per prompt, for draft lengths 1..max, next to an
untrained draft (the floor); checks the speculative output equals plain greedy decoding token for token.
Entry: `measure(cfg, store, prompts, out)`, the same shape as online_bench.measure; writes
out/acceptance.json.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from pathlib import Path

import torch

from pipeline import intervals
from pipeline.acceptance import batched
from pipeline.acceptance.draft_model import ExportedDraft
from pipeline.capture.hf import Capture
from pipeline.formats import eval_plots, eval_reports, train_summary
from pipeline.formats import export_layouts as lay
from pipeline.formats.run_dir import RunDir
from pipeline.models import draft as draft_lib
from pipeline.models import targets

log = logging.getLogger(__name__)


@torch.no_grad()
def speculate(
    model, capture: Capture, dr: ExportedDraft, prompt: list[int], max_new: int, k: int, eos: int | None
):
    """Greedy chain speculative decoding. Returns (generated ids, accepted-per-round list)."""
    from transformers import DynamicCache

    dev = model.device
    past = DynamicCache()
    out = model(input_ids=torch.tensor([prompt], device=dev), past_key_values=past, use_cache=True)
    aux = capture.states()[0][0]
    nxt = int(out.logits[0, -1].argmax())
    ctx_tok, ctx_hid = prompt[1:] + [nxt], dr.fuse(aux)  # draft input at position t: token t+1, fused aux t
    generated, rounds = [nxt], []
    while len(generated) < max_new and nxt != eos:
        tok, hid, props = list(ctx_tok), ctx_hid, []
        for _ in range(k):  # the chain: each step feeds the draft's own output hidden state back
            pos = torch.arange(1, len(tok) + 1, device=dev)
            h = dr.layer(torch.tensor(tok, device=dev), hid, pos)[-1]
            props.append(dr.next_target_id(h))
            tok, hid = tok + [props[-1]], torch.cat([hid, h[None]])
        out = model(input_ids=torch.tensor([[nxt] + props], device=dev), past_key_values=past, use_cache=True)
        verify = out.logits[0].argmax(-1).tolist()
        a = 0
        while a < k and verify[a] == props[a]:
            a += 1
        new = props[:a] + [verify[a]]
        aux = capture.states()[0][0, : a + 1]
        if a < k:
            past.crop(-(k - a))  # keep nxt and the accepted proposals: drop the k - a rejected ones
        ctx_tok, ctx_hid = ctx_tok + new, torch.cat([ctx_hid, dr.fuse(aux)])
        rounds.append(a)
        for t in new:
            generated.append(t)
            if t == eos or len(generated) >= max_new:
                break
        nxt = generated[-1]
    return generated[:max_new], rounds


def teacher_forced(
    model, capture: Capture, dr: ExportedDraft, prompt: list[int], continuation: list[int]
) -> torch.Tensor:
    """Step-0 hits of the draft along the target's own continuation, teacher-forced as training's acc_0 is: at
    each position t from the prompt's last token on, the draft reads the target's aux states of the sequence
    up to t and token t+1, and hits when its proposal is token t+2. Returns a bool per continuation token
    after the first ([len(continuation) - 1]). Speculation at k = 1 asks exactly these questions, but only at
    the positions where rounds start (after an accepted proposal it skips the verifier's bonus token), so its
    first-position acceptance
    is this accuracy at a sample of positions that leans toward where the draft failed."""
    seq, P = prompt + continuation, len(prompt)
    dev = model.device
    model(input_ids=torch.tensor([seq], device=dev))
    aux = capture.states()[0][0]
    out = dr.layer(
        torch.tensor(seq[1:], device=dev), dr.fuse(aux[:-1]), torch.arange(1, len(seq), device=dev)
    )
    return dr.next_target_ids(out[P - 1 : len(seq) - 2]) == torch.tensor(seq[P + 1 :], device=dev)


# inside one_target(): {"on": True, "key": what was loaded, "target": the tuple _target returns}
_HELD: dict = {}


@contextmanager
def one_target():
    """Inside it, every _target call returns one loaded target (evaluate: its prompt sets and mt_bench_turn2's
    first answers share one load of the fp32 target, not one each); on exit its hooks go and, once the
    callers'
    references are gone, its memory goes back to the device. Not nestable (evaluate.run holds the one)."""
    if _HELD.get("on"):
        raise RuntimeError("offline.one_target() is already held")
    _HELD["on"] = True
    try:
        yield
    finally:
        held = _HELD.pop("target", None)
        _HELD.clear()
        if held is not None:
            device = held[2]
            held[4].remove()  # the hooks hold the model
            del held
            if device.type == "cuda":
                torch.cuda.empty_cache()


def _target(cfg, store):
    """(folder, tokenizer, device, model, capture hooks): the target in fp32 on eval.device (fp32: greedy
    equality is exact, not bf16-noisy). Inside one_target(), the one it holds (the first one loaded)."""
    folder = Path(store.facts["target_path"])
    device, _ = targets.pick_device_dtype(cfg.eval.device, "fp32")
    key = (str(folder), str(device), tuple(store.aux_layer_ids))
    if _HELD.get("key") == key:
        return _HELD["target"]
    model = targets.load_model(folder, cfg.target, device, torch.float32, "sdpa")
    target = (
        folder,
        targets.load_tokenizer(folder, cfg.target),
        device,
        model,
        Capture(model, store.aux_layer_ids),
    )
    if _HELD.get("on") and "target" not in _HELD:
        _HELD.update(key=key, target=target)
    return target


def _done(target) -> None:
    """After a use: its hooks go now (without that, the fp32 copy outlives every reference), unless
    one_target()
    holds it for the next use."""
    if _HELD.get("target") is not target:
        target[4].remove()


def greedy_answers(cfg, store, prompts: list[list[int]], max_new: int) -> list[str]:
    """The target's own greedy answer to each prompt (fp32 on eval.device, eval.batch_size prompts at a
    time), at most
    max_new tokens, decoded: what evaluate puts before a second turn (mt_bench_turn2)."""
    target = _target(cfg, store)
    _, tok, _, model, capture = target
    size = max(cfg.eval.batch_size, 1)
    try:
        with torch.no_grad():
            ids = [
                g
                for i in range(0, len(prompts), size)
                for g in batched.greedy(model, capture, prompts[i : i + size], max_new, tok.eos_token_id)
            ]
    finally:
        _done(target)
    return [tok.decode(g, skip_special_tokens=True).strip() for g in ids]


def measure(cfg, store, prompts: list[list[int]], out: Path) -> Path:
    """tau of the exported draft (and of an untrained one) over the prompts; out/acceptance.json + tau.png."""
    e = cfg.eval
    # its presence is the stage's precondition (evaluate.run); damaged or in another layout: one line
    tensors, config = lay.read_sglang(RunDir.of(cfg).export("sglang"))
    target = _target(cfg, store)
    folder, tok, device, model, capture = target
    embed = model.get_input_embeddings().weight.detach()
    trained = ExportedDraft(tensors, config, embed, device)
    untrained = ExportedDraft(untrained_tensors(cfg, store, folder), config, embed, device)
    report = {
        "prompts": len(prompts),
        "max_new_tokens": e.max_new_tokens,
        "draft_lengths": list(range(1, e.max_draft + 1)),
        "batch_size": e.batch_size,
    }
    chunks = [prompts[i : i + e.batch_size] for i in range(0, len(prompts), e.batch_size)]
    eos = tok.eos_token_id
    greedy_refs = _greedy_refs(model, capture, tok, device, prompts, chunks, e)
    ks = list(range(1, e.max_draft + 1))
    for name, dr in (("trained", trained), ("untrained", untrained)):
        report[name] = {}
        # batched: every k of a chunk in one pass (eval.batch_size prompts x max_draft rows)
        all_runs = (
            batched.by_k(model, capture, dr, prompts, e.max_new_tokens, ks, eos, e.batch_size)
            if e.batch_size > 1
            else None
        )
        for k in ks:
            report[name][str(k)] = _tau_at(
                model, capture, dr, prompts, greedy_refs, all_runs, k, eos, e, name
            )
        _teacher_forced_acc(model, capture, dr, prompts, greedy_refs, name, report)
    # step-0 accuracy along the target's greedy continuations, beside training's own (its last validation) and
    # the first-position acceptance at k = 1: the same question asked at every position vs where rounds start
    tf = report["teacher_forced_acc_0"]
    tf.update(
        training_val_full_acc_0=_trained_val_acc0(cfg),
        training_val_evalpos_token_acc_0=_trained_val_acc0(cfg, "evalpos_token_acc_0"),
        accept_first_position_k1=report["trained"]["1"]["accept_per_position"][0],
    )
    if tf["trained"] is not None:
        log.info(
            "eval trained draft: step-0 accuracy teacher-forced along these continuations %.3f (95%% CI %s; "
            "%s after a hit, "
            "%s after a miss; training's last val at these positions %s, full_acc_0 %s); first-position "
            "acceptance at k=1 %.3f "
            "(rounds "
            "start after the draft's misses)",
            tf["trained"],
            [round(x, 3) for x in tf.get("trained_ci95") or []],
            _fmt(tf.get("after_hit")),
            _fmt(tf.get("after_miss")),
            _fmt(tf["training_val_evalpos_token_acc_0"]),
            _fmt(tf["training_val_full_acc_0"]),
            tf["accept_first_position_k1"],
        )
    _done(target)
    _log_table(cfg, report, prompts, out)
    out.mkdir(parents=True, exist_ok=True)
    eval_reports.write(out, False, report)
    eval_plots.tau(report, out / eval_reports.TAU_PNG)
    return out


def _greedy_refs(model, capture, tok, device, prompts, chunks, e) -> list[list[int]]:
    """The target's greedy continuations: the reference every speculative run must equal."""
    eos = tok.eos_token_id
    if e.batch_size > 1:
        return [g for c in chunks for g in batched.greedy(model, capture, c, e.max_new_tokens, eos)]
    else:  # plain greedy decoding, the reference every speculative run must equal
        return [
            model.generate(
                torch.tensor([p], device=device),
                max_new_tokens=e.max_new_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=tok.pad_token_id,
            )[0, len(p) :].tolist()
            for p in prompts
        ]


def _tau_at(model, capture, dr, prompts, greedy_refs, all_runs, k: int, eos, e, name: str) -> dict:
    """tau, acceptance per position and greedy mismatches of one draft at draft length k."""
    runs = (
        all_runs[k]
        if all_runs is not None
        else [speculate(model, capture, dr, p, e.max_new_tokens, k, eos) for p in prompts]
    )
    per_prompt, pooled_rounds, mismatches, by_prompt = [], [], 0, []
    for (gen, rounds), greedy in zip(runs, greedy_refs):
        mismatches += gen != greedy
        per_prompt.append(sum(r + 1 for r in rounds) / max(len(rounds), 1))
        pooled_rounds += rounds
        by_prompt.append(rounds)
    accept = [
        sum(r >= i for r in pooled_rounds) / max(sum(r >= i - 1 for r in pooled_rounds), 1)
        for i in range(1, k + 1)
    ]
    result = {
        "tau": sum(r + 1 for r in pooled_rounds) / max(len(pooled_rounds), 1),
        "tau_ci95": tau_interval(by_prompt),
        "prompts": len(by_prompt),
        "tau_per_prompt": per_prompt,
        "accept_per_position": accept,
        "target_forwards": len(pooled_rounds),
        "greedy_mismatches": mismatches,
    }
    log.info(
        "eval %s draft k=%d: tau %.3f (95%% CI %s over %d prompts), acceptance per position %s, greedy "
        "mismatches %d",
        name,
        k,
        result["tau"],
        result["tau_ci95"],
        result["prompts"],
        [round(x, 3) for x in accept],
        mismatches,
    )
    return result


def tau_interval(rounds_by_prompt: list[list[int]], resamples: int = 2000, seed: int = 0) -> list[float]:
    """A 95 % bootstrap interval of the pooled tau, resampling prompts (the unit that varies: a set of 8
    prompts moves tau by tenths). [tau, tau] with one prompt; seeded, so a report is reproducible."""
    pairs = [(sum(r + 1 for r in rounds), len(rounds)) for rounds in rounds_by_prompt]
    return intervals.ratio_ci95(pairs, resamples, seed)


def _teacher_forced_acc(model, capture, dr, prompts, greedy_refs, name: str, report: dict) -> None:
    """Step-0 accuracy teacher-forced along the greedy continuations (and, for the trained draft, whether
    misses
    cluster: the hit rate right after a hit and right after a miss), into report["teacher_forced_acc_0"]."""
    with torch.no_grad():
        rows = [
            teacher_forced(model, capture, dr, p, g).cpu() for p, g in zip(prompts, greedy_refs) if len(g) > 1
        ]
    hits = torch.cat(rows or [torch.zeros(0, dtype=torch.bool)])
    tf = report.setdefault("teacher_forced_acc_0", {"tokens": len(hits)})
    tf[name] = float(hits.float().mean()) if len(hits) else None
    if name == "trained":
        # its interval over prompts, the unit that varies (16 prompts move it by several points)
        tf["trained_ci95"] = intervals.ratio_ci95([(int(r.sum()), len(r)) for r in rows]) if rows else None
        # do misses cluster? the hit rate right after a hit and right after a miss
        prev, nxt = (
            (torch.cat([r[:-1] for r in rows]), torch.cat([r[1:] for r in rows])) if rows else (hits, hits)
        )
        tf["after_hit"] = float(nxt[prev].float().mean()) if prev.any() else None
        tf["after_miss"] = float(nxt[~prev].float().mean()) if (~prev).any() else None


def _log_table(cfg, report: dict, prompts, out: Path) -> None:
    e = cfg.eval
    ks = report["draft_lengths"]
    lines = ["tau (tokens per target forward)  " + "".join(f"{'k=' + str(k):>8}" for k in ks)]
    for name, label in (("trained", "trained draft"), ("untrained", "untrained draft (floor)")):
        lines.append(f"{label:<33}" + "".join(f"{report[name][str(k)]['tau']:>8.3f}" for k in ks))
        ci = [report[name][str(k)]["tau_ci95"] for k in ks]
        label = f"  95% CI, {report[name][str(ks[0])]['prompts']} prompts"
        lines.append(f"{label:<33}" + "".join(f"{f'{lo:.2f}-{hi:.2f}':>11}" for lo, hi in ci))
    where = (
        "held-out" if out == RunDir.of(cfg).eval else out.name
    )  # eval/, or eval/<set>/ of another prompt set
    log.info(
        "evaluate, %d %s prompts x %d new tokens:\n%s",
        len(prompts),
        where,
        e.max_new_tokens,
        "\n".join(lines),
    )


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _trained_val_acc0(cfg, key: str = "full_acc_0"):
    """Training's last validation figure (train/final/train_summary.json), or None where there is none:
    full_acc_0, or evalpos_token_acc_0 (this one's question at these positions: training/positions.py)."""
    try:
        val = train_summary.read(RunDir.of(cfg).final)["val_after"]
        if key.startswith("evalpos_") and val.get("eval_max_new_tokens") != cfg.eval.max_new_tokens:
            return None  # measured at other positions than this evaluate scores
        return float(val[key])
    except (OSError, KeyError, TypeError, ValueError):
        return None


def untrained_tensors(cfg, store, folder: Path) -> dict:
    """The floor: speculators' initial draft (same seed, same vocab), through the same SGLang layout."""
    from pipeline.formats import vocab_map

    d2t, t2d, _ = vocab_map.load(RunDir.of(cfg).vocab)
    torch.manual_seed(cfg.seed)
    config = json.loads((RunDir.of(cfg).export("sglang") / "config.json").read_text())
    m = draft_lib.build(
        folder,
        targets.load_config(folder, cfg.target),
        store.aux_layer_ids,
        d2t,
        t2d,
        1,
        arch=lay.draft_arch_of_export(config).name,
    )
    return {lay.speculators_to_sglang_name(k): v.detach() for k, v in lay.draft_owned(m.state_dict()).items()}
