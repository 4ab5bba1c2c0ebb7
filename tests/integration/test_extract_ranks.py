"""Data-parallel capture (issue #15 item 4): `torchrun --nproc-per-node 2 -m pipeline stage=extract` (hf
backend) has rank r capture and commit the shards r, r+2, ... of those not yet committed; the manifest stays
consistent under concurrent commits (a lock around its read-modify-replace). The store is byte-identical to
the one process writes, and so is the store after one rank is killed with SIGKILL mid-shard and the same
command is run again.

Every run is a subprocess with one torch thread (torchrun's default per rank), so the arithmetic is the
same."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipeline.formats import feature_store as fs
from pipeline.stages import prepare

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
ARGS = ["target=tiny", "data.limit=48", "extract.shard_tokens=2500", "extract.batch_tokens=300"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _cmd(run_dir: Path, cache_dir: str, ranks: int, *extra: str) -> list[str]:
    head = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        if ranks > 1
        else [sys.executable]
    )
    return head + [
        "-m",
        "pipeline",
        "stage=extract",
        *ARGS,
        *extra,
        f"run_dir={run_dir}",
        f"cache_dir={cache_dir}",
    ]


def _files(features: Path) -> dict:
    """Every file of the store (the manifest included) by relative path -> bytes; the lock file is empty."""
    return {str(p.relative_to(features)): p.read_bytes() for p in sorted(features.rglob("*")) if p.is_file()}


def _rank_pid(launcher: subprocess.Popen, rank: int) -> int | None:
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "pipeline" in child.cmdline():
                return child.pid
        except psutil.Error:
            continue
    return None


@pytest.fixture(scope="module")
def one_process_store(make_cfg, tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("extract_ranks")
    run_dir = root / "one"
    prepare.run(make_cfg(*ARGS, run_dir=run_dir))
    r = subprocess.run(
        _cmd(run_dir, cache_dir, 1), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = fs.read_manifest(run_dir / "features")
    assert manifest["complete"] and len(manifest["shards"]) >= 4, "too few shards to deal over 2 ranks"
    return root, run_dir


def _prepared_copy(make_cfg, root: Path, name: str) -> Path:
    run_dir = root / name
    prepare.run(make_cfg(*ARGS, run_dir=run_dir))
    return run_dir


def test_two_rank_capture_writes_the_store_one_process_writes(make_cfg, one_process_store, cache_dir):
    root, one = one_process_store
    two = _prepared_copy(make_cfg, root, "two")
    r = subprocess.run(
        _cmd(two, cache_dir, 2), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    log = r.stdout + r.stderr
    n = len(fs.read_manifest(one / "features")["shards"])
    assert f"rank 0 of 2: {(n + 1) // 2} shard(s)" in log and f"rank 1 of 2: {n // 2} shard(s)" in log, log[
        -3000:
    ]
    assert _files(two / "features") == _files(one / "features")
    assert (
        json.loads((two / "stages.json").read_text())["extract"]["fingerprint"]
        == json.loads((one / "stages.json").read_text())["extract"]["fingerprint"]
    )


def test_shards_written_by_several_workers_at_once_equal_one_writers(make_cfg, one_process_store, cache_dir):
    """extract.write_workers=3: 3 spawned processes encode and write every shard's chunks from shared memory
    (issue
    #14); the store, its manifest and the stage's fingerprint are byte for byte those of one writer."""
    root, one = one_process_store
    three = _prepared_copy(make_cfg, root, "three_writers")
    r = subprocess.run(
        _cmd(three, cache_dir, 1, "extract.write_workers=3", "extract.writer=zarr"),
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert (
        "extract: 3 writer processes" in r.stdout + r.stderr
    )  # not this process alone (no /dev/shm fallback)
    assert _files(three / "features") == _files(one / "features")
    assert (
        json.loads((three / "stages.json").read_text())["extract"]["fingerprint"]
        == json.loads((one / "stages.json").read_text())["extract"]["fingerprint"]
    )


def test_a_rank_killed_mid_shard_then_the_same_command_gives_the_same_store(
    make_cfg, one_process_store, cache_dir
):
    root, one = one_process_store
    run_dir = _prepared_copy(make_cfg, root, "killed")
    features = run_dir / "features"
    proc = subprocess.Popen(
        _cmd(run_dir, cache_dir, 2), cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    killed, deadline = None, time.time() + 300
    while killed is None and time.time() < deadline and proc.poll() is None:
        manifest = fs.read_manifest(features) if (features / fs.MANIFEST).exists() else None
        if (
            manifest and manifest["shards"] and list(features.glob("*.tmp"))
        ):  # >= 1 committed, one being written
            killed = _rank_pid(proc, 1)
            if killed:
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.01)
    proc.wait(timeout=300)
    assert killed is not None, "extract finished before rank 1 could be killed: make it longer"
    assert proc.returncode != 0  # torchrun stops the other rank and fails
    left = fs.read_manifest(features)
    total = len(fs.read_manifest(one / "features")["shards"])
    assert not left.get("complete") and 0 < len(left["shards"]) < total
    r = subprocess.run(
        _cmd(run_dir, cache_dir, 2), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"({len(left['shards'])} already committed)" in r.stdout + r.stderr
    assert not list(features.glob("*.tmp"))
    assert _files(features) == _files(one / "features")


def test_stages_without_a_multi_rank_implementation_are_refused_on_several_ranks(tmp_path, cache_dir):
    r = subprocess.run(
        _cmd(tmp_path, cache_dir, 1)[:1]
        + ["-m", "pipeline", "stage=vocab", f"run_dir={tmp_path}", f"cache_dir={cache_dir}"],
        cwd=ROOT,
        env={**ENV, "WORLD_SIZE": "2", "RANK": "1"},
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert (
        r.stderr.strip()
        .splitlines()[-1]
        .startswith("eaglepipe: error: stage=vocab on 2 ranks: only extract and train")
    )
