"""Shared fixtures: a target cache for the whole session, Hydra composition, built targets. And the order
in which CI's two workers take the test files: longest first."""

import fcntl
import json
import os
from collections import defaultdict
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from pipeline.config import register

CONF = str(Path(__file__).resolve().parents[1] / "conf")
register()

# Seconds each test file took in CI (setup, call and teardown of its tests, summed). `make test` runs
# `--dist loadfile --no-loadscope-reorder`: xdist hands whole files to its workers in collection order, one
# more whenever a worker runs short. Files sorted longest first make that greedy schedule end with short files
# on both workers, instead of one worker starting a 6-minute file while the other runs out of work.
# Re-measure: EAGLEPIPE_FILE_SECONDS=tests/file_seconds.json make test (written when the session ends).
FILE_SECONDS = Path(__file__).with_name("file_seconds.json")
_spent: dict[str, float] = defaultdict(float)


def _file(nodeid: str) -> str:
    return nodeid.split("::")[0]


def pytest_collection_modifyitems(config, items):
    seconds = json.loads(FILE_SECONDS.read_text())["seconds"] if FILE_SECONDS.is_file() else {}
    first = {}
    for i, item in enumerate(items):
        first.setdefault(_file(item.nodeid), i)
    items.sort(key=lambda it: (-seconds.get(_file(it.nodeid), 0.0), first[_file(it.nodeid)]))


def pytest_runtest_logreport(report):
    _spent[_file(report.nodeid)] += report.duration


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("EAGLEPIPE_FILE_SECONDS")
    if out and not hasattr(session.config, "workerinput"):  # the controller sees every worker's reports
        table = dict(sorted(((f, round(s, 1)) for f, s in _spent.items()), key=lambda kv: -kv[1]))
        total = round(sum(_spent.values()), 1)
        Path(out).write_text(json.dumps({"seconds": table, "total": total}, indent=1) + "\n")


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
def exported_run(make_cfg, tmp_path_factory, worker_id):
    """One tiny run through export (both layouts, each verified in its engine's own class): (run_dir,
    facts). Built once per session: under xdist the workers share one (the session's temporary root, a lock;
    the tests that read it write nothing into it: test_cli's tools check that of every tool)."""
    from pipeline.formats.feature_store import FeatureStore
    from pipeline.runner import run_stages

    if worker_id == "master":  # no xdist: this session's own
        run_dir = tmp_path_factory.mktemp("exported_run")
    else:  # the session's root, above each worker's own base
        run_dir = tmp_path_factory.getbasetemp().parent / "exported_run"
    with open(f"{run_dir}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker waits while one builds
        if "export" not in _records(run_dir):  # recorded once the export stage finished
            for stage in ("prepare", "extract", "vocab", "train", "export"):
                run_stages(
                    make_cfg(
                        "+experiment=tiny",
                        "data.limit=16",
                        "train.max_steps=4",
                        f"stage={stage}",
                        run_dir=run_dir,
                    )
                )
    return run_dir, FeatureStore(run_dir / "features").facts


def _records(run_dir: Path) -> dict:
    from pipeline.runner import read_records

    return read_records(run_dir) if (run_dir / "stages.json").is_file() else {}


@pytest.fixture(scope="session")
def mutate():
    from mutations import mutated_copy

    return mutated_copy
