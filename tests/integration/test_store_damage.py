"""Damaged features (#12 B4, B5): a flipped or truncated chunk stops train in one line naming the shard and
the array; `check-store` lists every damaged chunk; `extract.repair=true` extracts exactly those shards
again."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
RUN = ["+experiment=tiny", "data.limit=8", "extract.chunk_tokens=64", "extract.shard_tokens=2048"]


def cli(*args, cache_dir):
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args, f"cache_dir={cache_dir}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def store_run(tmp_path_factory, cache_dir):
    run_dir = tmp_path_factory.mktemp("store_run")
    for stage in ("prepare", "extract", "vocab"):
        r = cli(*RUN, f"stage={stage}", f"run_dir={run_dir}", cache_dir=cache_dir)
        assert r.returncode == 0, r.stderr[-2000:]
    return run_dir


@pytest.fixture
def run_copy(store_run, tmp_path):
    shutil.copytree(store_run, tmp_path / "run")
    return tmp_path / "run"


def _one_error_line(r) -> str:
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("eaglepipe: error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    return errors[0]


def _flip(path: Path, count: int = 60) -> None:
    b = bytearray(path.read_bytes())
    for i in range(min(count, len(b) - 8)):
        b[4 + i] ^= 0xA5
    path.write_bytes(bytes(b))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


@pytest.mark.parametrize("damage,workers", [(_flip, 0), (_truncate, 1)])
def test_train_refuses_a_damaged_chunk_in_one_line(run_copy, cache_dir, damage, workers):
    damage(run_copy / "features/shard-00000.zarr/aux_hidden/c/1/0")
    r = cli(*RUN, "stage=train", f"train.num_workers={workers}", f"run_dir={run_copy}", cache_dir=cache_dir)
    line = _one_error_line(r)
    assert "shard-00000.zarr/aux_hidden: chunk 1 fails its crc32c check" in line, line
    assert f"extract.repair=true run_dir={run_copy}" in line
    assert not (run_copy / "train/final").exists()


def test_check_store_finds_flipped_and_truncated_chunks_and_passes_a_good_store(run_copy, cache_dir):
    good = cli("check-store", f"run_dir={run_copy}", cache_dir=cache_dir)
    assert good.returncode == 0 and "every chunk passes its crc32c check" in good.stdout, good.stderr[-2000:]
    _flip(run_copy / "features/shard-00000.zarr/aux_hidden/c/1/0")
    _truncate(run_copy / "features/shard-00000.zarr/last_hidden/c/0/0")
    before = sorted(p.relative_to(run_copy) for p in run_copy.rglob("*"))
    r = cli("check-store", f"run_dir={run_copy}", cache_dir=cache_dir)
    line = _one_error_line(r)
    assert "2 damaged chunk(s) in 1 of" in line and "shard-00000.zarr" in line, line
    assert (
        "shard-00000.zarr/aux_hidden chunk 1:" in r.stdout
        and "shard-00000.zarr/last_hidden chunk 0:" in r.stdout
    )
    assert sorted(p.relative_to(run_copy) for p in run_copy.rglob("*")) == before  # a tool writes nothing


def test_extract_repair_redoes_the_damaged_shard_byte_identically(store_run, run_copy, cache_dir):
    chunk = "features/shard-00000.zarr/aux_hidden/c/1/0"
    _flip(run_copy / chunk)
    r = cli(*RUN, "stage=extract", "extract.repair=true", f"run_dir={run_copy}", cache_dir=cache_dir)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (run_copy / chunk).read_bytes() == (store_run / chunk).read_bytes()
    manifest = "features/manifest.json"
    assert (run_copy / manifest).read_bytes() == (store_run / manifest).read_bytes()  # vocab still matches
    assert cli("check-store", f"run_dir={run_copy}", cache_dir=cache_dir).returncode == 0


def test_resume_never_on_a_damaged_store_destroys_no_earlier_checkpoint(run_copy, cache_dir):
    """train.resume=never used to delete every checkpoint and final/ first, then meet the damaged chunk
    (#12)."""
    old = {
        "step_000010/train_state.json": '{"optimizer_step": 10}',
        "final/train_summary.json": '{"steps": 40}',
    }
    for name, text in old.items():
        (run_copy / "train" / name).parent.mkdir(parents=True, exist_ok=True)
        (run_copy / "train" / name).write_text(text)
    _flip(run_copy / "features/shard-00000.zarr/aux_hidden/c/1/0")
    r = cli(
        *RUN,
        "stage=train",
        "train.resume=never",
        "train.save_every_steps=1000",
        f"run_dir={run_copy}",
        cache_dir=cache_dir,
    )
    assert "fails its crc32c check" in _one_error_line(r)
    aside = run_copy / "train" / ".replaced" / "000"
    assert {name: (aside / name).read_text() for name in old} == old  # set aside, whole: move them back
    assert "moved to" in r.stderr + r.stdout
