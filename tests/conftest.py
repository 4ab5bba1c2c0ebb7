"""Shared fixtures: a target cache for the whole session, Hydra composition, built targets."""

import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from pipeline.config import register

CONF = str(Path(__file__).resolve().parents[1] / "conf")
register()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    """Targets are built once per cache; CI points EAGLEPIPE_CACHE into the clone so builds are reused."""
    return os.environ.get("EAGLEPIPE_CACHE") or str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def make_cfg(cache_dir):
    def make(*overrides: str, run_dir=None):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            extra = [f"cache_dir={cache_dir}"] + ([f"run_dir={run_dir}"] if run_dir else [])
            return compose(config_name="config", overrides=[*extra, *overrides])

    return make


@pytest.fixture(scope="session")
def tiny_folder(make_cfg, cache_dir):
    from pipeline.models import targets

    return targets.resolve(make_cfg("target=tiny").target, cache_dir)


@pytest.fixture(scope="session")
def kimi_folder(make_cfg, cache_dir):
    from pipeline.models import targets

    return targets.resolve(make_cfg("target=kimi_tiny").target, cache_dir)


@pytest.fixture(scope="session")
def smol_folder(make_cfg, cache_dir):
    from pipeline.models import targets

    return targets.resolve(make_cfg("target=smollm2").target, cache_dir)


@pytest.fixture(scope="session")
def exported_run(make_cfg, tmp_path_factory):
    """One tiny run through export (both layouts, each verified in its engine's own class): (run_dir,
    facts)."""
    from pipeline.formats.feature_store import FeatureStore
    from pipeline.runner import run_stages

    run_dir = tmp_path_factory.mktemp("exported_run")
    for stage in ("prepare", "extract", "vocab", "train", "export"):
        run_stages(
            make_cfg(
                "+experiment=tiny", "data.limit=16", "train.max_steps=4", f"stage={stage}", run_dir=run_dir
            )
        )
    return run_dir, FeatureStore(run_dir / "features").facts


@pytest.fixture(scope="session")
def mutate():
    from mutations import mutated_copy

    return mutated_copy
