"""Issue #35, rule 4: every damaged artifact is one line naming the file and the fix; `check-store` and
`extract.repair=true` work on a store whose manifest or shard metadata is damaged (they exist for exactly
that). Each case damages a copy of one tiny run (the session's exported_run) and runs what a user would."""

import errno
import filecmp
import json
import shutil
import subprocess

import pytest

from pipeline.errors import UserError
from pipeline.formats import faults
from pipeline.runner import run_stages

pytestmark = pytest.mark.slow
RUN = ["+experiment=tiny", "data.limit=16", "train.max_steps=4"]  # the exported_run fixture's overrides


@pytest.fixture(scope="module")
def done(exported_run):
    """The tiny run through export, never damaged: each test damages a copy of it."""
    return exported_run[0]


@pytest.fixture
def run(done, tmp_path):
    shutil.copytree(done, tmp_path / "run")  # copy2: mtimes kept, so every stage is up to date in the copy
    return tmp_path / "run"


def stage(make_cfg, run_dir, name, *extra):
    return run_stages(make_cfg(*RUN, f"stage={name}", *extra, run_dir=run_dir))


def one_line(make_cfg, run_dir, name, *extra) -> str:
    """What the command says: a UserError (printed as one line, exit 2 by pipeline/__main__.py)."""
    with pytest.raises(UserError) as e:
        stage(make_cfg, run_dir, name, *extra)
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def empty(path):
    path.write_bytes(b"")


def same_store(a, b) -> bool:
    """Every file of two feature stores byte for byte (the lock file aside)."""
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file() and p.name != ".manifest.lock")
    theirs = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file() and p.name != ".manifest.lock")
    return files == theirs and all(filecmp.cmp(a / f, b / f, shallow=False) for f in files)


# ------------------------------------------------------------------------------- the store's manifest
@pytest.mark.parametrize("damage", [truncate, empty])
def test_damaged_artifact_a_damaged_manifest_is_one_line_for_every_command(make_cfg, run, damage, capsys):
    manifest = run / "features/manifest.json"
    damage(manifest)
    fix = f"extract.repair=true run_dir={run}"
    for name in ("extract", "vocab", "all"):
        line = one_line(make_cfg, run, name)
        assert f"{manifest} is damaged" in line and fix in line, (name, line)
    line = one_line(make_cfg, run, "check_store")
    assert f"{manifest} is damaged" in line and "1 of 1 shard(s) on disk verify" in line and fix in line, line
    listed = capsys.readouterr().out
    assert "manifest.json: cannot be read" in listed and "shard-00000.zarr: verifies" in listed, listed


def test_damaged_artifact_repair_rebuilds_a_damaged_manifest_from_the_shards_that_verify(make_cfg, run, done):
    shard = run / "features/shard-00000.zarr"
    inode = shard.stat().st_ino
    truncate(run / "features/manifest.json")
    stage(make_cfg, run, "extract", "extract.repair=true")
    assert shard.stat().st_ino == inode  # kept as it was: it verifies against its own metadata
    assert same_store(run / "features", done / "features")  # manifest byte for byte: vocab, train stay valid
    stage(make_cfg, run, "check_store")


def test_damaged_artifact_repair_rebuilds_the_manifest_and_redoes_a_shard_that_does_not_verify(
    make_cfg, run, done
):
    empty(run / "features/manifest.json")
    truncate(run / "features/shard-00000.zarr/last_hidden/zarr.json")
    stage(make_cfg, run, "extract", "extract.repair=true")
    assert same_store(run / "features", done / "features")


# ------------------------------------------------------------------------------- a shard's zarr.json
@pytest.mark.parametrize("where", ["", "aux_hidden/", "offsets/"], ids=["group", "aux_hidden", "offsets"])
def test_damaged_artifact_a_damaged_shard_zarr_json_is_listed_by_check_store(make_cfg, run, where, capsys):
    truncate(run / "features/shard-00000.zarr" / where / "zarr.json")
    line = one_line(make_cfg, run, "check_store")
    assert "in 1 of 1 shard(s)" in line and "shard-00000.zarr" in line and "extract.repair=true" in line, line
    array = where.rstrip("/") or "(group)"
    assert f"shard-00000.zarr/{array}: zarr.json cannot be read" in capsys.readouterr().out


def test_damaged_artifact_a_damaged_array_zarr_json_is_one_line_for_train_and_redone_by_repair(
    make_cfg, run, done
):
    truncate(run / "features/shard-00000.zarr/aux_hidden/zarr.json")
    line = one_line(make_cfg, run, "train", "train.max_steps=5")
    assert "shard-00000.zarr/aux_hidden: zarr.json cannot be read" in line and "extract.repair=true" in line
    stage(make_cfg, run, "extract", "extract.repair=true")
    assert same_store(run / "features", done / "features")


# ------------------------------------------------------------------------------- the other artifacts
def test_damaged_artifact_garbage_in_stages_json_is_one_line_naming_it(make_cfg, run):
    (run / "stages.json").write_text('{"prepare": {"fingerpr')
    line = one_line(make_cfg, run, "all")
    assert f"{run / 'stages.json'} is damaged" in line and "delete it" in line, line
    (run / "stages.json").write_text('{"prepare": 3}')
    assert f"{run / 'stages.json'} is damaged" in one_line(make_cfg, run, "prepare")


def flip_d2t(path):
    """One high bit of d2t[10] flipped: the file reads, its offset table breaks."""
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    start = json.loads(data[8 : 8 + n])["d2t"]["data_offsets"][0]
    data[8 + n + start + 8 * 10 + 6] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [truncate, flip_d2t])
def test_damaged_artifact_a_damaged_vocab_is_one_line_naming_the_file(make_cfg, run, damage):
    damage(run / "vocab/vocab.safetensors")
    line = one_line(make_cfg, run, "train", "train.max_steps=5")
    assert f"{run / 'vocab/vocab.safetensors'} is damaged" in line and "rerun stage=vocab" in line, line


def test_damaged_artifact_a_damaged_prepared_arrow_file_is_one_line_naming_it(make_cfg, run):
    (arrow,) = (run / "prepared").glob("*.arrow")
    truncate(arrow)
    line = one_line(make_cfg, run, "extract", "extract.repair=true")
    assert f"{run / 'prepared'}" in line and "is damaged" in line and "rerun stage=prepare" in line, line


def test_damaged_artifact_a_damaged_export_read_by_evaluate_is_one_line(make_cfg, run):
    truncate(run / "export/sglang/model.safetensors")
    line = one_line(make_cfg, run, "evaluate")
    assert f"{run / 'export/sglang'}" in line and "stage=export" in line, line


def test_damaged_artifact_an_export_in_the_vllm_layout_read_by_evaluate_is_one_line(make_cfg, run):
    shutil.rmtree(run / "export/sglang")
    shutil.copytree(run / "export/vllm", run / "export/sglang")  # layers.0.*, its own manifest and sha256
    line = one_line(make_cfg, run, "evaluate")
    assert f"{run / 'export/sglang/model.safetensors'}" in line and "layers.0.*" in line, line
    assert "midlayer.*" in line and "stage=export" in line, line


def test_damaged_artifact_features_that_is_a_file_is_one_line(make_cfg, run):
    shutil.rmtree(run / "features")
    (run / "features").write_text("not a store")
    for name in ("extract", "vocab", "check_store"):
        line = one_line(make_cfg, run, name)
        assert f"{run / 'features'} is a file, not a directory" in line, (name, line)
    assert (run / "features").read_text() == "not a store"


# ------------------------------------------------------------------------------- a full disk
def test_damaged_artifact_a_full_disk_is_recognised_in_each_writers_words(tmp_path):
    python = OSError(errno.ENOSPC, "No space left on device", "/r/stages.json.tmp")
    assert faults.disk_full(python, tmp_path).startswith("disk full while writing /r/stages.json.tmp (")
    tensorstore = ValueError(
        'RESOURCE_EXHAUSTED: Error writing local file "/r/features/shard-00000.zarr.tmp/aux_hidden/c/8/0": '
        "Failed to write 24562 bytes to file 8: No space left on device [os_error_code='28']"
    )
    line = faults.disk_full(tensorstore, tmp_path)
    assert line.startswith("disk full while writing /r/features/shard-00000.zarr.tmp/aux_hidden/c/8/0 (")
    safetensors = RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert faults.disk_full(safetensors, tmp_path).startswith(f"disk full while writing {tmp_path} (")
    for other in (ValueError("bad value"), OSError(errno.EACCES, "Permission denied", "/r/x"), KeyError("x")):
        assert faults.disk_full(other, tmp_path) is None  # tmp_path's disk has room: not a full disk


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of a few MB (mount needs root, CI's and this machine's user): ENOSPC from the real kernel."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], check=False).returncode:
        pytest.skip("cannot mount a tmpfs here (not root): the full-disk cases need one")
    yield disk
    subprocess.run(["umount", "--lazy", str(disk)], check=True)  # the prepared set may still be mapped


def resize(disk, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(disk)], check=True)


def test_damaged_artifact_a_full_disk_mid_extract_is_one_line_and_the_rerun_finishes(
    make_cfg, done, small_disk
):
    run = small_disk / "run"
    run.mkdir()
    shutil.copytree(done / "prepared", run / "prepared")
    shutil.copy2(done / "stages.json", run / "stages.json")
    line = one_line(make_cfg, run, "extract")
    assert line.startswith(f"disk full while writing {run / 'features'}") and "rerun the same command" in line
    resize(small_disk, "64m")
    stage(make_cfg, run, "extract")
    assert same_store(run / "features", done / "features")


def test_damaged_artifact_a_full_disk_mid_train_is_one_line(make_cfg, done, small_disk):
    resize(small_disk, "64m")
    run = small_disk / "run"
    run.mkdir()
    for name in ("prepared", "features", "vocab"):
        shutil.copytree(done / name, run / name)
    used = shutil.disk_usage(run).used
    resize(small_disk, f"{used // 1024 + 600}k")  # the inputs and 600 KB: less than a checkpoint
    line = one_line(make_cfg, run, "train")
    assert line.startswith("disk full while writing") and str(run) in line, line
    assert "rerun the same command" in line
