"""Captured features equal an independent reference, bit for bit; kill/resume; store guards."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from pipeline.capture.hf import plan_batches
from pipeline.capture.store import plan_shards
from pipeline.errors import UserError
from pipeline.formats import prepared
from pipeline.formats.feature_store import FeatureStore
from pipeline.models import targets
from pipeline.stages import extract, prepare

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def reference_features(cfg, store: FeatureStore):
    """output_hidden_states of the full CausalLM over the same padded batches: aux = hidden_states[k+1];
    last = hidden_states[-1] of a copy whose final norm is replaced by Identity (HF's is post-norm)."""
    folder = targets.resolve(cfg.target, cfg.cache_dir)
    model = targets.load_model(
        folder, cfg.target, torch.device("cpu"), torch.float32, cfg.extract.attn_implementation
    )
    prenorm = targets.load_model(
        folder, cfg.target, torch.device("cpu"), torch.float32, cfg.extract.attn_implementation
    )
    prenorm.model.norm = torch.nn.Identity()
    aux_ids = store.aux_layer_ids
    lengths = store.sample_lengths()
    out = {}
    for spec in plan_shards(lengths, cfg.extract.shard_tokens):
        for batch in plan_batches(spec.lengths, cfg.extract.batch_tokens, cfg.extract.max_batch_size):
            g = [spec.sample_start + i for i in batch]
            width = int(lengths[g[0]])
            ids = torch.zeros(len(g), width, dtype=torch.long)
            attn = torch.zeros_like(ids)
            for r, s in enumerate(g):
                ids[r, : lengths[s]] = store.sample(s)["input_ids"]
                attn[r, : lengths[s]] = 1
            with torch.no_grad():
                hs = model(input_ids=ids, attention_mask=attn, output_hidden_states=True).hidden_states
                hs_pre = prenorm(input_ids=ids, attention_mask=attn, output_hidden_states=True).hidden_states
            for r, s in enumerate(g):
                n = lengths[s]
                last_id = (
                    len(hs) - 2
                )  # HF hidden_states[L] is post-norm: for aux id L-1 the reference is the pre-norm one
                out[s] = (
                    torch.cat(
                        [(hs_pre if k == last_id else hs)[k + 1][r, :n] for k in aux_ids], -1
                    ).bfloat16(),
                    hs_pre[-1][r, :n].bfloat16(),
                    hs[-1][r, :n].bfloat16(),
                )
    return out


@pytest.mark.parametrize(
    "target,overrides",
    [
        ("tiny", ["data.limit=12", "extract.shard_tokens=3000", "extract.batch_tokens=1500"]),
        (
            "smollm2",
            [
                "data.limit=4",
                "prepare.max_len=128",
                "extract.shard_tokens=200",
                "extract.batch_tokens=256",
                "extract.aux_layers=[0,14,29]",
            ],
        ),
    ],
)
def test_captured_features_equal_output_hidden_states_bit_for_bit(make_cfg, tmp_path, target, overrides):
    cfg = make_cfg(f"target={target}", *overrides, run_dir=tmp_path)
    prepare.run(cfg)
    extract.run(cfg)
    store = FeatureStore(tmp_path / "features")
    ref = reference_features(cfg, store)
    assert len(ref) == len(store) > 1 and len(store.shards) > 1
    for s, (aux_ref, last_ref, postnorm) in ref.items():
        got = store.sample(s)
        assert torch.equal(got["aux_hidden"].view(torch.int16), aux_ref.view(torch.int16)), s
        assert torch.equal(got["last_hidden"].view(torch.int16), last_ref.view(torch.int16)), s
        assert not torch.equal(got["last_hidden"], postnorm)  # the post-norm state is NOT what we store
    ds, _ = prepared.load(tmp_path)
    assert [store.sample(i)["input_ids"].tolist() for i in range(len(store))] == ds["input_ids"]
    assert [store.sample(i)["loss_mask"].tolist() for i in range(len(store))] == ds["loss_mask"]


def _arrays(root: Path) -> dict:
    out = {}
    for shard in sorted(root.glob("shard-*.zarr")):
        g = zarr.open_group(str(shard), mode="r")
        out[shard.name] = (
            {k: g[k][:] for k in ("input_ids", "loss_mask", "offsets", "aux_hidden", "last_hidden")},
            dict(g.attrs),
        )
    return out


def _cli(run_dir, cache_dir, *extra):
    return [
        sys.executable,
        "-m",
        "pipeline",
        "stage=extract",
        "target=tiny",
        f"run_dir={run_dir}",
        f"cache_dir={cache_dir}",
        "data.limit=48",
        "extract.shard_tokens=2500",
        "extract.batch_tokens=300",
        *extra,
    ]


def test_extract_killed_with_sigkill_and_rerun_equals_an_uninterrupted_run(make_cfg, tmp_path, cache_dir):
    for d in ("a", "b"):
        prepare.run(make_cfg("target=tiny", "data.limit=48", run_dir=tmp_path / d))
    extract.run(
        make_cfg(
            "target=tiny",
            "data.limit=48",
            "extract.shard_tokens=2500",
            "extract.batch_tokens=300",
            run_dir=tmp_path / "a",
        )
    )
    features = tmp_path / "b" / "features"
    proc = subprocess.Popen(
        _cli(tmp_path / "b", cache_dir), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:  # kill mid-shard, after >= 1 committed shard
        manifest = features / "manifest.json"
        if manifest.exists() and json.loads(manifest.read_text())["shards"] and list(features.glob("*.tmp")):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "extract finished before it could be killed: make it longer"
    killed = json.loads((features / "manifest.json").read_text())
    assert not killed.get("complete") and 0 < len(killed["shards"]) < len(
        list((tmp_path / "a" / "features").glob("shard-*"))
    )
    done = subprocess.run(_cli(tmp_path / "b", cache_dir), cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"({len(killed['shards'])} already committed)" in done.stdout + done.stderr
    a, b = _arrays(tmp_path / "a" / "features"), _arrays(features)
    assert list(a) == list(b)
    for name in a:
        for key in a[name][0]:
            assert np.array_equal(a[name][0][key], b[name][0][key]), (name, key)
        assert a[name][1] == b[name][1]
    assert not list(features.glob("*.tmp"))


def test_features_from_other_aux_layers_are_refused_not_mixed(make_cfg, tmp_path):
    cfg = make_cfg("target=tiny", "data.limit=4", run_dir=tmp_path)
    prepare.run(cfg)
    extract.run(cfg)
    with pytest.raises(
        UserError, match=r"aux_layer_ids: store=\[1, 3, 4\] asked=\[0, 2, 5\].*extract.overwrite=true"
    ):
        extract.run(make_cfg("target=tiny", "data.limit=4", "extract.aux_layers=[0,2,5]", run_dir=tmp_path))
    extract.run(
        make_cfg(
            "target=tiny",
            "data.limit=4",
            "extract.aux_layers=[0,2,5]",
            "extract.overwrite=true",
            run_dir=tmp_path,
        )
    )
    assert FeatureStore(tmp_path / "features").aux_layer_ids == [0, 2, 5]


def test_prepared_data_from_another_target_is_refused(make_cfg, tmp_path):
    prepare.run(make_cfg("target=tiny", "data.limit=2", run_dir=tmp_path))
    with pytest.raises(UserError, match="tokenized for another target"):
        extract.run(make_cfg("target=smollm2", "data.limit=2", run_dir=tmp_path))
