"""Fingerprints hash only what shapes a stage's artefact: a knob that cannot change the output (prefetch
workers, wandb, a timeout, a server knob the offline bench never reads) leaves the stage up to date; one that
can (lr, ttt_steps, the seed, the draft lengths) reruns it."""

import json
import sys

import pytest

from pipeline import runner as stages
from pipeline.fingerprint import shaping
from pipeline.stages import evaluate, train
from pipeline.training import setup


def fp(module, make_cfg, run_dir, *overrides):
    return module.fingerprint(make_cfg("+experiment=tiny", *overrides, run_dir=run_dir))


@pytest.mark.parametrize(
    "override",
    [
        "train.num_workers=4",
        "train.wandb.mode=disabled",
        "train.wandb.project=x",
        "train.resume=never",
        "train.keep_last=9",
        "train.save_every_steps=7",
    ],
)
def test_train_knobs_that_cannot_change_the_draft_keep_its_fingerprint(make_cfg, tmp_path, override):
    assert fp(train, make_cfg, tmp_path, override) == fp(train, make_cfg, tmp_path)


@pytest.mark.parametrize(
    "override",
    [
        "train.lr=1e-3",
        "train.ttt_steps=2",
        "seed=1",
        "train.max_steps=3",
        "train.tokens_per_pack=128",
        "train.log_every_steps=3",
        "train.device=cpu",
        "train.adam_betas=[0.9,0.95]",
    ],
)
def test_train_knobs_that_shape_the_draft_or_its_curves_change_its_fingerprint(make_cfg, tmp_path, override):
    assert fp(train, make_cfg, tmp_path, override) != fp(train, make_cfg, tmp_path)


def test_the_vocabulary_it_trains_on_is_in_trains_fingerprint(make_cfg, tmp_path):
    before = fp(train, make_cfg, tmp_path)
    (tmp_path / "vocab").mkdir()
    (tmp_path / "vocab" / "manifest.json").write_text('{"coverage": 0.9}')
    assert fp(train, make_cfg, tmp_path) != before


@pytest.mark.parametrize(
    "override,same",
    [
        ("eval.endpoint_timeout_s=5", True),
        ("eval.concurrency=[4]", True),
        ("eval.repeats=5", True),
        ("eval.warmup_prompts=0", True),
        ("eval.baseline_endpoint=http://b:1", True),  # the offline bench talks to no server
        ("eval.max_draft=2", False),
        ("eval.num_prompts=7", False),
        ("eval.max_new_tokens=9", False),
        ("eval.device=cpu", False),
        ("eval.endpoint=http://s:1", False),
    ],
)
def test_offline_evaluate_hashes_what_the_offline_bench_reads(make_cfg, tmp_path, override, same):
    assert (fp(evaluate, make_cfg, tmp_path, override) == fp(evaluate, make_cfg, tmp_path)) is same


@pytest.mark.parametrize(
    "override,same",
    [
        ("eval.endpoint_timeout_s=5", True),
        ("eval.max_draft=2", True),
        ("eval.device=cpu", True),  # not read online
        ("eval.concurrency=[4]", False),
        ("eval.repeats=5", False),
        ("eval.warmup_prompts=0", False),
        ("eval.baseline_endpoint=http://b:1", False),
        ("eval.num_prompts=7", False),
    ],
)
def test_online_evaluate_hashes_what_the_online_bench_reads(make_cfg, tmp_path, override, same):
    online = "eval.endpoint=http://s:1"
    assert (
        fp(evaluate, make_cfg, tmp_path, online, override) == fp(evaluate, make_cfg, tmp_path, online)
    ) is same


def test_first_answer_tokens_is_hashed_only_when_a_second_turn_set_reads_it(make_cfg, tmp_path):
    """A knob added later (mt_bench_turn2's first answers) leaves earlier evaluate fingerprints as they
    were."""
    change = "eval.first_answer_tokens=17"
    assert fp(evaluate, make_cfg, tmp_path, change) == fp(evaluate, make_cfg, tmp_path)
    turn2 = "eval.sets=[heldout,mt_bench_turn2]"
    assert fp(evaluate, make_cfg, tmp_path, turn2, change) != fp(evaluate, make_cfg, tmp_path, turn2)


def test_train_knobs_are_hashed_at_every_value_with_no_compatibility_defaults(make_cfg, tmp_path):
    """No knob is left out of train's fingerprint at the value it had before it existed (no shims before
    1.0): pad_packs null and false, adam_betas at AdamW's old (0.9, 0.95), are each hashed as they are."""
    assert fp(train, make_cfg, tmp_path) != fp(train, make_cfg, tmp_path, "train.pad_packs=false")
    assert fp(train, make_cfg, tmp_path) != fp(train, make_cfg, tmp_path, "train.pad_packs=true")
    t = make_cfg("+experiment=tiny", "train.adam_betas=[0.9,0.95]").train
    assert shaping(t, setup.NOT_SHAPING)["adam_betas"] == [0.9, 0.95]
    assert shaping(t, setup.NOT_SHAPING)["draft_arch"] == "llama"


def test_shaping_refuses_a_left_out_knob_the_section_does_not_have(make_cfg):
    cfg = make_cfg("+experiment=tiny")
    assert "num_workers" not in shaping(cfg.train, train.NOT_SHAPING)
    assert shaping(cfg.train)["resume"] == "auto"  # enums as plain names
    with pytest.raises(KeyError, match="num_worker"):
        shaping(cfg.train, ("num_worker",))


@pytest.fixture
def finished_train(make_cfg, tmp_path, monkeypatch):
    """A run dir whose train stage is recorded as done; train.run replaced by a recorder."""
    (tmp_path / "train" / "final").mkdir(parents=True)
    (tmp_path / "train" / "final" / "train_summary.json").write_text("{}")
    cfg = make_cfg("+experiment=tiny", "stage=train", run_dir=tmp_path)
    stages.write_record(tmp_path, "train", {"fingerprint": train.fingerprint(cfg)})
    ran = []
    monkeypatch.setattr(
        sys.modules["pipeline.stages.train"], "run", lambda cfg: ran.append(cfg) or tmp_path / "train"
    )
    return tmp_path, ran


def test_changing_num_workers_keeps_train_up_to_date(make_cfg, finished_train):
    run_dir, ran = finished_train
    stages.run_stages(make_cfg("+experiment=tiny", "stage=train", "train.num_workers=3", run_dir=run_dir))
    assert ran == []


def test_changing_lr_reruns_train(make_cfg, finished_train):
    run_dir, ran = finished_train
    stages.run_stages(make_cfg("+experiment=tiny", "stage=train", "train.lr=1e-3", run_dir=run_dir))
    assert len(ran) == 1
    assert json.loads((run_dir / "stages.json").read_text())["train"]["fingerprint"] == train.fingerprint(
        ran[0]
    )


def test_sglang_knobs_shape_only_sglang_stores(make_cfg, tmp_path):
    from pipeline.stages import extract

    hf = fp(extract, make_cfg, tmp_path)
    assert fp(extract, make_cfg, tmp_path, "extract.sglang_attention_backend=triton") == hf
    assert fp(extract, make_cfg, tmp_path, "extract.sglang_mem_fraction=0.3") == hf
    sgl = fp(extract, make_cfg, tmp_path, "extract.backend=sglang")
    assert sgl != hf
    assert (
        fp(extract, make_cfg, tmp_path, "extract.backend=sglang", "extract.sglang_attention_backend=triton")
        != sgl
    )
    assert fp(extract, make_cfg, tmp_path, "extract.backend=sglang", "extract.sglang_mem_fraction=0.3") == sgl


def test_the_online_sources_hash_leaves_out_the_hosts_compute_dtype_and_nothing_else():
    """vocab (CPU, fp32) and train (GPU, bf16) may run on different hosts: the online facts' hash must not
    follow
    compute_dtype, and must follow every fact that changes the states."""
    import torch

    from pipeline.capture.features import OnlineFeatures

    base = {
        "aux_layer_ids": [1, 3, 4],
        "hidden_size": 64,
        "target_fingerprint": "t0",
        "compute_dtype": "float32",
        "prepared_fingerprint": "p0",
        "max_len": 2048,
    }

    def h(**change):
        return OnlineFeatures(
            {**base, **change}, None, None, None, torch.device("cpu"), torch.float32, "sdpa"
        ).manifest_hash()

    assert h(compute_dtype="bfloat16") == h()
    for key, value in (
        ("aux_layer_ids", [1, 2, 4]),
        ("target_fingerprint", "t1"),
        ("prepared_fingerprint", "p1"),
        ("hidden_size", 65),
        ("max_len", 1024),
    ):
        assert h(**{key: value}) != h(), key


def test_data_knobs_are_hashed_at_their_defaults_and_a_change_reprepares(make_cfg, tmp_path, monkeypatch):
    """The data section is hashed whole (no knob left out at the value it had before it existed); a source
    added, or another leak policy, prepares again."""
    from omegaconf import OmegaConf

    from pipeline.stages import prepare

    cfg = make_cfg("+experiment=tiny", run_dir=tmp_path)
    seen = []
    monkeypatch.setattr(prepare, "digest", lambda d: seen.append(d) or "x")
    prepare.fingerprint(cfg)
    assert seen[-1]["data"] == OmegaConf.to_container(cfg.data, resolve=True, enum_to_str=True)
    monkeypatch.undo()
    for change in ("data.extra_sources=[chatterbot]", "data.on_leak=drop"):
        assert prepare.fingerprint(
            make_cfg("+experiment=tiny", change, run_dir=tmp_path)
        ) != prepare.fingerprint(cfg)


def test_a_data_file_replaced_by_other_content_of_the_same_size_and_mtime_reruns_prepare(
    make_cfg, tmp_path, caplog
):
    """#50: prepare's fingerprint read a data file's size and mtime, so a file replaced by other bytes of the
    same size, its mtime set back (cp -p, rsync -t, a restored backup), was "up to date". It reads the content
    now, and says so in the log; the same bytes written again (a new mtime) keep it up to date."""
    import logging
    import os

    from pipeline.stages import prepare

    caplog.set_level(logging.INFO)
    data = tmp_path / "chats.jsonl"
    data.write_text('{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}\n')
    st = data.stat()
    args = ("data=sharegpt", f"data.path={data}")
    first = fp(prepare, make_cfg, tmp_path, *args)
    assert f"{data} read by content for its fingerprint: 1 file(s)" in caplog.text
    data.write_text(data.read_text().replace('"yo"', '"ok"'))  # same size
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert data.stat().st_size == st.st_size and data.stat().st_mtime_ns == st.st_mtime_ns
    assert fp(prepare, make_cfg, tmp_path, *args) != first
    data.write_text(data.read_text().replace('"ok"', '"yo"'))  # the first bytes again, a new mtime
    assert fp(prepare, make_cfg, tmp_path, *args) == first
