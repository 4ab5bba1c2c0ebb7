"""Training: a real learning signal, bit-identical resume after SIGKILL, packing isolation, aux ids flow."""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pipeline.data.features_dataset import collate, plan_packs
from pipeline.formats.feature_store import FeatureStore
from pipeline.models import draft
from pipeline.runner import run_stages
from pipeline.training.setup import load_inputs

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_run(make_cfg, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tiny_run")
    cfg = make_cfg("+experiment=tiny", run_dir=run_dir)
    run_stages(cfg)
    return cfg, run_dir


def test_trained_draft_beats_an_untrained_one_on_held_out_samples(tiny_run):
    _, run_dir = tiny_run
    summary = json.loads((run_dir / "train" / "final" / "train_summary.json").read_text())
    before, after = summary["val_before"], summary["val_after"]
    assert after["full_acc_0"] > before["full_acc_0"] + 0.15, (before, after)
    assert after["loss_0"] < before["loss_0"]
    assert (run_dir / "train" / "plots" / "curves.png").stat().st_size > 10_000
    rows = [json.loads(x) for x in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    assert {"loss_2", "full_acc_2", "cond_acc_2", "tokens_per_s", "lr"} <= set(rows[1])


def test_the_validation_split_is_recorded_and_evaluate_prompts_only_from_it(tiny_run):
    from pipeline.acceptance.prompts import heldout_prompts
    from pipeline.data.features_dataset import split

    cfg, run_dir = tiny_run
    summary = json.loads((run_dir / "train" / "final" / "train_summary.json").read_text())
    store = FeatureStore(run_dir / "features")
    train_idx, val_idx = split(len(store), cfg.train.val_fraction, cfg.seed)
    assert summary["val_samples"] == val_idx.tolist() and not set(summary["val_samples"]) & set(
        train_idx.tolist()
    )
    heldout = {tuple(store.sample(i)["input_ids"].tolist()) for i in summary["val_samples"]}
    prompts = heldout_prompts(cfg, store, 100, 10_000)
    assert prompts and all(any(h[: len(p)] == tuple(p) for h in heldout) for p in prompts)
    # evaluate follows the record, not its own recomputation: with another val_fraction it still asks train's
    changed = cfg.copy()
    changed.train.val_fraction = 0.5
    assert heldout_prompts(changed, store, 100, 10_000) == prompts


def test_aux_layer_ids_flow_from_the_store_into_the_draft(make_cfg, tmp_path):
    cfg = make_cfg(
        "+experiment=tiny",
        "data.limit=12",
        "extract.aux_layers=[0,2,5]",
        "train.max_steps=2",
        run_dir=tmp_path,
    )
    run_stages(cfg)
    config = json.loads((tmp_path / "train" / "final" / "config.json").read_text())
    assert (
        config["eagle_aux_hidden_state_layer_ids"]
        == [0, 2, 5]
        == FeatureStore(tmp_path / "features").aux_layer_ids
    )
    weights = load_file(str(tmp_path / "train" / "final" / "model.safetensors"))
    assert weights["fc.weight"].shape == (64, 3 * 64)


def _cmd(run_dir, cache_dir):
    return [
        sys.executable,
        "-m",
        "pipeline",
        "+experiment=tiny",
        f"run_dir={run_dir}",
        f"cache_dir={cache_dir}",
        "train.max_steps=60",
        "train.save_every_steps=5",
        "train.keep_last=20",
        "train.val_every_steps=1000",
    ]


def test_training_killed_and_resumed_ends_bit_identical(make_cfg, tmp_path, cache_dir):
    """b is killed after its step-5 checkpoint and resumed; a, on a copy of b's inputs, trains straight
    through beside it (two processes at once: each spends seconds importing)."""
    for stage in ("prepare", "extract", "vocab"):
        run_stages(make_cfg("+experiment=tiny", f"stage={stage}", run_dir=tmp_path / "b"))
    for name in ("prepared", "features", "vocab"):
        shutil.copytree(tmp_path / "b" / name, tmp_path / "a" / name)
    straight_log = open(tmp_path / "a.log", "w+")
    straight = subprocess.Popen(
        _cmd(tmp_path / "a", cache_dir) + ["stage=train"],
        cwd=ROOT,
        stdout=straight_log,
        stderr=subprocess.STDOUT,
    )
    proc = subprocess.Popen(
        _cmd(tmp_path / "b", cache_dir) + ["stage=train"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        if (tmp_path / "b" / "train" / "step_000005" / "train_state.json").exists():
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "training finished before it could be killed"
    assert not (tmp_path / "b" / "train" / "final").exists()
    resumed = subprocess.run(
        _cmd(tmp_path / "b", cache_dir) + ["stage=train"], cwd=ROOT, capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "train: resumed from" in resumed.stdout + resumed.stderr
    straight.wait(timeout=600)
    straight_log.seek(0)
    assert straight.returncode == 0, straight_log.read()[-3000:]
    straight_log.close()
    a = load_file(str(tmp_path / "a" / "train" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "train" / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_packing_isolates_documents(tiny_run):
    cfg, run_dir = tiny_run
    store = FeatureStore(run_dir / "features")
    store_facts_folder = Path(store.facts["target_path"])
    d2t, t2d, _ = load_inputs(cfg)[1:]
    from pipeline.models import targets

    model = draft.build(
        store_facts_folder,
        targets.load_config(store_facts_folder, cfg.target),
        store.aux_layer_ids,
        d2t,
        t2d,
        3,
    ).eval()
    batch = collate(store, [0, 1], 10_000)
    batch.pop("verifier_last_hidden_states")  # logits only, no loss
    n0 = int((batch["document_ids"] == 0).sum())
    logits = []
    handle = model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o.detach().clone()))

    def second_doc_logits(b):
        logits.clear()
        with torch.no_grad():
            model(**{k: (v.float() if v.is_floating_point() else v) for k, v in b.items()}, ttt_steps=3)
        return [x[0, n0:] for x in logits]

    base = second_doc_logits(batch)
    perturbed = dict(batch)
    perturbed["hidden_states"] = batch["hidden_states"].clone()
    perturbed["hidden_states"][0, :n0] += 3.0  # change only the first sample's features
    perturbed["input_ids"] = batch["input_ids"].clone()
    perturbed["input_ids"][0, : n0 - 1] = (batch["input_ids"][0, : n0 - 1] + 7) % 1024
    after = second_doc_logits(perturbed)
    for step, (x, y) in enumerate(zip(base, after)):
        assert torch.allclose(x, y, atol=1e-6, rtol=0), f"TTT step {step}: sample 1 saw sample 0"
    # the check can fail: with one document id for both samples, sample 1 does see sample 0
    merged = {**perturbed, "document_ids": torch.zeros_like(batch["document_ids"])}
    leaked = second_doc_logits(merged)
    handle.remove()
    assert not torch.allclose(base[0], leaked[0], atol=1e-6, rtol=0)


def test_packs_respect_the_token_budget_and_cover_each_position_once():
    import numpy as np

    from pipeline.data.features_dataset import split_points

    lengths = np.array([5, 300, 40, 2, 1, 80, 700])
    packs = plan_packs(np.arange(7), lengths, 400, seed=0, epoch=0, context=100)
    pieces = [piece for p in packs for piece in p]
    assert sorted({i for i, _, _ in pieces}) == [
        0,
        1,
        2,
        3,
        5,
        6,
    ]  # the 1-token sample has nothing to predict
    assert all(sum(min(lengths[i] - 1 - a, 400) for i, a, _ in p) <= 400 for p in packs)
    scored = {}  # every shifted position of every sample is scored in exactly one piece
    for i, a, c in pieces:
        for pos in range(a + c, a + min(lengths[i] - 1 - a, 400)):
            scored[(i, pos)] = scored.get((i, pos), 0) + 1
    assert set(scored.values()) == {1} and len(scored) == int((lengths - 1).clip(min=0).sum())
    assert [(a, c) for i, a, c in pieces if i == 6] == [(0, 0), (300, 100)]  # 699 positions: 400 + 299 new
    assert split_points(699, 400, 100) == [(0, 0), (300, 100)] and split_points(400, 400, 100) == [(0, 0)]
    assert split_points(1000, 400, 0) == [(0, 0), (400, 0), (800, 0)]
    assert packs != plan_packs(np.arange(7), lengths, 400, seed=0, epoch=1, context=100) or len(packs) == 1


def test_a_split_window_keeps_its_positions_and_scores_only_its_new_tokens(tiny_run):
    cfg, run_dir = tiny_run
    store = FeatureStore(run_dir / "features")
    i = int(np.argmax(store.sample_lengths()))
    s, m = store.sample(i), int(store.sample_lengths()[i]) - 1
    whole = collate(store, [i], m)
    window = collate(store, [(i, 40, 10)], 64)  # positions 40..103, the first 10 context only
    n = min(m - 40, 64)
    assert window["position_ids"][0].tolist() == list(range(41, 41 + n))
    assert torch.equal(window["hidden_states"][0], whole["hidden_states"][0, 40 : 40 + n])
    assert torch.equal(window["input_ids"][0], whole["input_ids"][0, 40 : 40 + n])
    assert not window["loss_mask"][0, :10].any()
    want = s["loss_mask"][51 : 41 + n].bool() & s["loss_mask"][52 : 42 + n].bool()
    assert torch.equal(window["loss_mask"][0, 10:], want)  # input and predicted token both the answer's
    with pytest.raises(ValueError, match="splits it"):
        collate(store, [i], 16)  # a bare index must fit: nothing is ever cut silently


def test_samples_longer_than_a_pack_are_split_not_cut(make_cfg, tmp_path, caplog):
    """tokens_per_pack=512 with samples up to 2,048 tokens once cut each sample to its first 512 tokens with
    nothing in the log (issue #12, B7). Now they are split into windows; every position is trained once."""
    import logging

    from pipeline.formats.feature_store import FeatureStore as Store

    caplog.set_level(logging.INFO)
    for stage in ("prepare", "extract", "vocab", "train"):
        run_stages(
            make_cfg(
                "+experiment=tiny",
                "data.limit=16",
                "train.max_steps=2",
                "train.tokens_per_pack=128",
                f"stage={stage}",
                run_dir=tmp_path,
            )
        )
    summary = json.loads((tmp_path / "train" / "final" / "train_summary.json").read_text())
    split_ = summary["split_by_tokens_per_pack"]
    lengths = Store(tmp_path / "features").sample_lengths()
    train_idx = [i for i in range(len(lengths)) if i not in set(summary["val_samples"])]
    long = [i for i in train_idx if int(lengths[i]) - 1 > 128]
    # windows of 128 with stride 96 (context 32 = 128 // 4): 1 + ceil((m - 128) / 96) each
    want = sum(1 + -(-(int(lengths[i]) - 1 - 128) // 96) for i in long)
    assert split_["samples"] == len(long) > 0 and split_["pieces"] == want
    assert split_["context_positions"] == 32 * (want - len(long))
    assert f"longer than train.tokens_per_pack=128: split into {want} windows" in caplog.text


def test_a_padded_pack_gives_the_loss_metrics_and_gradients_of_the_unpadded_one(tiny_run):
    """train.pad_packs=true (one shape per step, issue #14): the padding attends only to itself, is never
    scored,
    and changes nothing the optimizer sees. fp32 on CPU."""
    from speculators.losses.utils import resolve_loss_config

    from pipeline.models import targets

    cfg, run_dir = tiny_run
    store = FeatureStore(run_dir / "features")
    folder = Path(store.facts["target_path"])
    d2t, t2d, _ = load_inputs(cfg)[1:]
    model = draft.build(folder, targets.load_config(folder, cfg.target), store.aux_layer_ids, d2t, t2d, 3)
    fwd = dict(ttt_steps=3, ttt_step_loss_decay=1.0, loss_config=resolve_loss_config("kl_div", "eager"))
    lengths = store.sample_lengths()
    packs = plan_packs(np.arange(len(lengths)), lengths, 512, seed=0, epoch=0, context=128)
    pack = next(p for p in packs if len(p) > 1 and sum(min(lengths[i] - 1 - a, 512) for i, a, _ in p) < 500)
    exact = collate(store, pack, 512)
    padded = collate(store, pack, 512, pad=True)
    n = exact["input_ids"].shape[1]
    assert padded["input_ids"].shape == (1, 512) and n < 512 and (padded["document_ids"][0, n:] == -1).all()
    extra = 512 - n  # what padding means, written out: document id -1, everything else 0, on the right
    fill = {
        k: torch.full((1, extra, *v.shape[2:]), -1 if k == "document_ids" else 0, dtype=v.dtype)
        for k, v in exact.items()
    }
    assert all(torch.equal(torch.cat([exact[k], fill[k]], 1), padded[k]) for k in exact)

    def loss_metrics_grads(batch):
        model.zero_grad()
        b = {k: (v.float() if v.is_floating_point() else v) for k, v in batch.items()}
        _, loss, metrics = model(**b, **fwd)
        loss.backward()
        return (
            loss.detach(),
            {k: float(v) for k, v in metrics.items()},
            {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None},
        )

    (l0, m0, g0), (l1, m1, g1) = loss_metrics_grads(exact), loss_metrics_grads(padded)
    assert torch.allclose(l0, l1, rtol=1e-5, atol=1e-7), (l0, l1)
    assert m0.keys() == m1.keys() and all(abs(m0[k] - m1[k]) <= 1e-5 * max(1.0, abs(m0[k])) for k in m0), (
        m0,
        m1,
    )
    assert g0.keys() == g1.keys() and g0
    for k in g0:
        assert torch.allclose(g0[k], g1[k], rtol=1e-4, atol=1e-7), k


def test_no_position_is_scored_past_an_answers_end_token(tiny_run):
    """Issue #47: shift_batch's mask l[t+1] scored the prediction of the token after each end-of-turn (a
    trivial hit serving never asks for); only a position whose predicted token is the answer's is scored."""
    _, run_dir = tiny_run
    store = FeatureStore(run_dir / "features")
    ends = 0
    for i in range(len(store.sample_lengths())):
        s, m = store.sample(i), int(store.sample_lengths()[i]) - 1
        if m < 1 or m > 512:
            continue
        mask, lm = collate(store, [i], m)["loss_mask"][0], s["loss_mask"].bool()
        predicted = torch.zeros(m, dtype=torch.bool)
        predicted[: m - 1] = lm[2 : m + 1]
        assert not (mask & ~predicted).any(), i  # never a position whose predicted token is not the answer's
        assert torch.equal(mask, lm[1 : m + 1] & predicted)
        ends += int((lm[1 : m + 1] & ~predicted).sum())  # end-of-turn inputs: left out
    assert ends > 0
