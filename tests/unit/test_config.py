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


GROUPS = sorted(
    p.name
    for p in CONF.iterdir()
    if p.is_dir() and p.name not in ("experiment", "hydra", "local", "accelerate")
)  # accelerate: launcher files, not Hydra


def repeated_defaults(yaml_node: dict, schema: dict, prefix: str = "") -> list[str]:
    """Keys of a YAML file whose value is the schema's own default (nested sections walked key by key)."""
    found = []
    for key, value in yaml_node.items():
        if key == "defaults" and not prefix:
            continue
        default = schema.get(key)
        if isinstance(value, dict) and isinstance(default, dict):
            found += repeated_defaults(value, default, f"{prefix}{key}.")
        elif key in schema and value == default:
            found.append(f"{prefix}{key}: {value!r}")
    return found


def schema_of(group: str | None) -> dict:
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    name = f"{group}/base_{group}.yaml" if group else "base_config.yaml"
    return OmegaConf.to_container(ConfigStore.instance().load(name).node, resolve=False, enum_to_str=True)


@pytest.mark.parametrize(
    "path",
    [CONF / "config.yaml"] + sorted(p for g in GROUPS for p in (CONF / g).glob("*.yaml")),
    ids=lambda p: str(p.relative_to(CONF)),
)
def test_a_yaml_holds_only_what_differs_from_its_schema(path):
    """A YAML value equal to the dataclass default is a second home for it: the two drift apart unnoticed."""
    from omegaconf import OmegaConf

    group = None if path.parent == CONF else path.parent.name
    node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    assert repeated_defaults(node, schema_of(group)) == [], (
        f"{path.relative_to(CONF)} repeats pipeline/config.py"
    )


def test_the_repeat_check_sees_nested_and_enum_defaults():
    schema = schema_of("train")
    assert repeated_defaults(
        {
            "defaults": ["base_train"],
            "lr": 3.0e-4,
            "epochs": 2,
            "resume": "auto",
            "wandb": {"mode": "offline", "project": "mine"},
        },
        schema,
    ) == ["lr: 0.0003", "resume: 'auto'", "wandb.mode: 'offline'"]


@pytest.mark.parametrize(
    "launcher,target",
    [("slurm", "SlurmLauncher"), ("local", "LocalLauncher"), ("submitit_local", "LocalLauncher")],
)
def test_the_cluster_launchers_compose_onto_the_submitit_plugin(launcher, target):
    """conf/hydra/launcher/{slurm,local}.yaml extend the plugin's own configs; a sweep job's dir is
    ${run_dir}/N."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=[f"hydra/launcher={launcher}", "run_dir=/r"],
            return_hydra_config=True,
        )
    assert cfg.hydra.launcher._target_.endswith(target)
    assert (
        cfg.hydra.launcher.timeout_min > 50
    )  # a preemption signal is not counted as one of the allowed time-outs
    assert cfg.hydra.sweep.dir == "/r"
    if launcher == "slurm":
        assert cfg.hydra.launcher.signal_delay_s >= 120 and cfg.hydra.launcher.gpus_per_node == 8


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_the_accelerate_configs_launch_bf16_gpu_ranks_without_accelerates_own_fsdp(name):
    import yaml

    cfg = yaml.safe_load((CONF / "accelerate" / f"{name}.yaml").read_text())
    assert cfg["distributed_type"] == "MULTI_GPU" and cfg["mixed_precision"] == "bf16" and not cfg["use_cpu"]
    assert not any(
        k.startswith("fsdp") for k in cfg
    )  # train.strategy=fsdp shards; accelerate's plugin would twice
    assert (
        f"train.strategy={name}" in (CONF / "accelerate" / f"{name}.yaml").read_text()
    )  # the knob it goes with


def test_pad_packs_defaults_to_one_shape_on_cuda_and_to_no_padding_on_cpu():
    """train.pad_packs=null: padded where speculators compiles the forward (CUDA), not on CPU; a set value
    wins."""
    from types import SimpleNamespace

    import torch

    from pipeline.config import TrainConfig
    from pipeline.training.setup import pad_packs

    assert TrainConfig().pad_packs is None
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert pad_packs(SimpleNamespace(pad_packs=None), cuda) is True
    assert pad_packs(SimpleNamespace(pad_packs=None), cpu) is False
    assert pad_packs(SimpleNamespace(pad_packs=False), cuda) is False
    assert pad_packs(SimpleNamespace(pad_packs=True), cpu) is True


def unread_fields(source: str) -> list[str]:
    """`Schema.field` for every field of the config schemas that no code in `source` reads (as `.field`,
    `["field"]` or `"field"`): a knob that changes nothing."""
    import dataclasses
    import re

    import pipeline.config as schemas

    unread = []
    for name in sorted(dir(schemas)):
        cls = getattr(schemas, name)
        if isinstance(cls, type) and dataclasses.is_dataclass(cls):
            for f in dataclasses.fields(cls):
                if not re.search(rf"\.{f.name}\b|\[[\"']{f.name}[\"']\]|[\"']{f.name}[\"']", source):
                    unread.append(f"{name}.{f.name}")
    return unread


def test_every_config_field_is_read_somewhere_in_pipeline():
    pkg = Path(__file__).resolve().parents[2] / "pipeline"
    source = "\n".join(
        p.read_text() for p in pkg.rglob("*.py") if p.name not in ("config.py", "config_choices.py")
    )
    assert unread_fields(source) == [], "read these in pipeline/ or remove them from pipeline/config.py"


def test_the_unread_field_check_names_a_field_nothing_reads():
    assert "TrainConfig.lr" in unread_fields("cfg.train.epochs\n")
    assert "TrainConfig.lr" not in unread_fields("t = cfg.train\nprint(t.lr)\n")
