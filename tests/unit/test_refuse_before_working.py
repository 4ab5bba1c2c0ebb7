"""Issue #35, rule 1, "refuse before working": every knob of the schema has a rule
(pipeline/config_limits.py), and a nonsense value of every one is refused in one line before the first stage
writes anything. A knob added to pipeline/config.py without a rule fails
test_refuse_before_working_every_knob_has_a_rule."""

import dataclasses
import enum
import math
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from pipeline import config_limits as cl
from pipeline.config import Config
from pipeline.errors import UserError
from pipeline.runner import run_stages

ROOT = Path(__file__).resolve().parents[2]


def schema_leaves(kind=Config, prefix=""):
    """(dotted key, leaf type) of every knob of the schema, `[]` for list elements."""
    hints = typing.get_type_hints(kind)
    for f in dataclasses.fields(kind):
        yield from _leaf(hints[f.name], f"{prefix}{f.name}")


def _leaf(t, key):
    args = [a for a in typing.get_args(t) if a is not type(None)]
    if typing.get_origin(t) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        yield from _leaf(args[0], key)
    elif dataclasses.is_dataclass(t):
        yield from schema_leaves(t, f"{key}.")
    elif typing.get_origin(t) is list:
        yield from _leaf(args[0], f"{key}[]")
    else:
        yield key, t


LEAVES = dict(schema_leaves())
NUMERIC = sorted(k for k, t in LEAVES.items() if t in (int, float))
STRINGS = sorted(k for k, t in LEAVES.items() if t is str or typing.get_origin(t) is dict)
COMPOSED = sorted(
    k for k, t in LEAVES.items() if t is bool or (isinstance(t, type) and issubclass(t, enum.Enum))
)


def test_refuse_before_working_every_knob_has_a_rule():
    ruled = set(cl.LIMITS) | set(cl.CHOICES) | set(cl.BY_STAGE) | set(cl.FREE)
    assert [k for k in NUMERIC if k not in set(cl.LIMITS) | set(cl.BY_STAGE)] == []
    assert [k for k in STRINGS if k not in ruled] == []
    assert [k for k in ruled if k not in LEAVES] == []  # no rule for a knob that is gone
    assert len(NUMERIC) > 80 and len(COMPOSED) > 20  # the walk found the schema


def nonsense(key):
    """An override putting `key` outside its rule."""
    if key in cl.LIMITS:
        r = cl.LIMITS[key]
        bad = (r.lo if r.lo_open else r.lo - 1) if r.lo is not None else (r.hi if r.hi_open else r.hi + 1)
        bad = int(bad) if LEAVES[key] is int else float(bad)
    else:
        bad = {
            "run_dir": "' '",
            "cache_dir": "' '",
            "engine": "sglangg",
            "train.loss": "kl_divv",
            "extract.attn_implementation": "flash",
            "data.sources[].limit": 0,
            "data.sources[].weight": 0,
            "data.sources[].heldout": -1,
        }.get(key, "nonsense")
    if key.startswith("data.sources[]."):
        return ["data=mix", f"data.sources=[{{format:chitchat,{key.split('.')[-1]}:{bad}}}]"]
    if key.endswith("[]"):
        return [f"{key[:-2]}=[{bad}]"]
    return [f"{key}={bad}"]


@pytest.mark.parametrize("key", sorted(set(cl.LIMITS) | set(cl.CHOICES) | set(cl.BY_STAGE)))
def test_refuse_before_working_a_nonsense_value_of_every_knob(make_cfg, tmp_path, key):
    cfg = make_cfg("+experiment=tiny", *nonsense(key), run_dir=str(tmp_path / "run"))
    if key == "run_dir":
        cfg.run_dir = " "
    with pytest.raises(UserError) as e:
        run_stages(cfg)
    shown = key.split("[]")[0] if key.startswith("data.sources") else key.removesuffix("[]")
    assert shown in str(e.value) or key in str(e.value)
    assert not (tmp_path / "run").exists()  # refused before prepare wrote anything


@pytest.mark.parametrize("key", COMPOSED)
def test_refuse_before_working_an_enum_or_bool_typo_fails_composition(make_cfg, key):
    override = f"{key.removesuffix('[]')}=nonsense"
    if key.startswith("data.sources[]."):
        override = f"data.sources=[{{format:chitchat,{key.split('.')[-1]}:nonsense}}]"
    with pytest.raises(ConfigCompositionException):
        make_cfg("+experiment=tiny", "data=mix", override)


def test_refuse_before_working_nan_and_inf_are_outside_every_range():
    assert not cl.Range(0, lo_open=True).holds(math.nan)
    assert not cl.Range(0).holds(math.inf)
    assert cl.Range(0, 1, hi_open=True).holds(0.5) and not cl.Range(0, 1, hi_open=True).holds(1.0)


def test_refuse_before_working_aux_ids_sglang_cannot_serve_on_a_kimi_target(make_cfg, tmp_path):
    """They were refused only at export, after prepare, extract, vocab and train ran (days on Kimi-K2.5)."""
    run = tmp_path / "run"
    cfg = make_cfg("+experiment=tiny", "target=kimi_tiny", "extract.aux_layers=[0,3,5]", run_dir=str(run))
    with pytest.raises(UserError, match=r"extract.aux_layers=\[0, 3, 5\] with export.engines=.*first id"):
        run_stages(cfg)
    assert not run.exists()
    from pipeline.runner import preflight

    # vLLM numbers them the Llama way: the same ids are servable there
    preflight(
        make_cfg(
            "+experiment=tiny", "target=kimi_tiny", "extract.aux_layers=[0,3,5]", "export.engines=[vllm]"
        ),
        ["extract"],
    )


def test_refuse_before_working_a_gpu_device_where_there_is_none(make_cfg, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for stage, key in (("extract", "extract.device"), ("evaluate", "eval.device"), ("train", "train.device")):
        cfg = make_cfg("+experiment=tiny", f"stage={stage}", f"{key}=cuda", run_dir=str(tmp_path / "run"))
        with pytest.raises(UserError, match=rf"{key}=cuda but this machine has no CUDA"):
            run_stages(cfg)
    # a CPU login node prepares with a GPU experiment's devices
    from pipeline.runner import preflight

    preflight(make_cfg("+experiment=tiny", "train.device=cuda", "extract.device=cuda"), ["prepare"])


def test_refuse_before_working_wandb_online_without_a_key(make_cfg, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    cfg = make_cfg("+experiment=tiny", "stage=train", "train.wandb.mode=online", run_dir=str(tmp_path / "r"))
    with pytest.raises(UserError, match="train.wandb.mode=online but no wandb key"):
        run_stages(cfg)
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password x\n")
    from pipeline.runner import preflight

    preflight(cfg, ["train"])


def eaglepipe(*args, cwd):
    env = {**os.environ, "EAGLEPIPE_CACHE": str(cwd / "cache")}
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "override,message",
    [
        ("+train.lrr=1e-9", "train.lrr is not a setting of eaglepipe; did you mean train.lr?"),
        ("train.lrr=1e-9", "train.lrr is not a setting of eaglepipe; did you mean train.lr?"),
        ("+resume=never", "resume is not a setting of eaglepipe; did you mean train.resume?"),
        ("run_dir=", "run_dir is empty (an unset shell variable?)"),
    ],
)
def test_refuse_before_working_unknown_keys_and_an_empty_run_dir(tmp_path, override, message):
    """`+key=` was accepted and ignored (Hydra's own hint for a misspelt key leads there); `run_dir=` wrote
    prepared/, stages.json and .hydra/ into the current directory."""
    r = eaglepipe("stage=prepare", "+experiment=tiny", f"run_dir={tmp_path / 'run'}", override, cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"eaglepipe: error: {message}"), r.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written, neither run dir nor cwd


def test_refuse_before_working_a_check_that_only_its_stage_needs_runs_where_that_stage_runs(make_cfg):
    """train.loss's check imports speculators (seconds of every SLURM job's start): a vocab job skips it, a
    chain that trains still refuses the typo, and so does a run that names no stages."""
    from pipeline.runner import check_judge

    cfg = make_cfg("+experiment=tiny", "train.loss=kl_divv")
    assert cl.problems(cfg, check_judge(cfg, ["vocab"])) == []
    assert any("train.loss" in p for p in cl.problems(cfg, check_judge(cfg, ["vocab", "train"])))
    assert any("train.loss" in p for p in cl.problems(cfg, check_judge(cfg, None)))
    assert any("train.loss" in p for p in cl.problems(cfg))


def test_refuse_before_working_the_loss_check_is_remembered_per_speculators_version(make_cfg, tmp_path):
    """`eaglepipe submit` judges train.loss again from cache_dir's memo, not from an 8 s import; the memo is a
    cache: damaged, it is only rebuilt."""
    from importlib.metadata import version

    from pipeline.formats import check_memo
    from pipeline.runner import check_judge

    def found(cfg):
        return cl.problems(cfg, check_judge(cfg, ["train"]))

    cfg = make_cfg("+experiment=tiny", "train.loss=kl_divv", f"cache_dir={tmp_path}")
    [problem] = [p for p in found(cfg) if "train.loss" in p]
    slot = f"speculators=={version('speculators')}"
    assert check_memo.read(tmp_path)[slot] == {"train.loss=kl_divv": problem}
    check_memo.remember(tmp_path, slot, "train.loss=kl_divv", "remembered")  # the memo is what answers
    assert "remembered" in found(cfg)
    check_memo.path(tmp_path).write_text("{not json")
    assert problem in found(cfg) and check_memo.read(tmp_path)[slot]["train.loss=kl_divv"] == problem
    ok = make_cfg("+experiment=tiny", f"cache_dir={tmp_path}")
    assert not [p for p in found(ok) if "train.loss" in p]
    assert check_memo.read(tmp_path)[slot][f"train.loss={ok.train.loss}"] is None
