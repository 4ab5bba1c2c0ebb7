from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

CONF = Path(__file__).resolve().parents[2] / "conf"


@pytest.mark.parametrize("target", sorted(p.stem for p in (CONF / "target").glob("*.yaml")))
def test_every_target_composes_with_its_shape(make_cfg, target):
    cfg = make_cfg(f"target={target}")
    assert cfg.target.num_layers > 0 and cfg.target.hidden_size > 0 and cfg.target.vocab_size > 0


@pytest.mark.parametrize("data", sorted(p.stem for p in (CONF / "data").glob("*.yaml")))
def test_every_data_source_composes(make_cfg, data):
    assert make_cfg(f"data={data}").data.format.value == data


def test_kimi_k25_has_the_seed_shape(make_cfg):
    t = make_cfg("target=kimi_k25").target
    assert (t.num_layers, t.hidden_size, t.vocab_size) == (61, 7168, 163840)


def test_typos_and_wrong_types_fail_at_composition(make_cfg):
    with pytest.raises(ConfigCompositionException):
        make_cfg("extract.aux_layer=[1,2]")
    with pytest.raises(ConfigCompositionException):
        make_cfg("extract.batch_tokens=lots")
    with pytest.raises(ConfigCompositionException):
        make_cfg("stage=finetune")


@pytest.mark.parametrize("override", ["train.resume=atuo", "train.resume=Auto", "train.wandb.mode=of"])
def test_closed_knobs_refuse_a_typo_at_composition(make_cfg, override):
    """train.resume=atuo once fell through to `never` and deleted every checkpoint (issue #12, B1)."""
    with pytest.raises(ConfigCompositionException):
        make_cfg(override)
    assert make_cfg("train.resume=never").train.resume.value == "never"


def test_run_dir_is_stable_and_named_after_the_inputs(make_cfg):
    assert make_cfg().run_dir == "runs/smollm2-135m-instruct-chitchat"
