"""Training on several processes (issue #15): `accelerate launch --cpu --num_processes 2` really starts 2
ranks (accelerate's --cpu alone starts one: eaglepipe relaunches through torch.distributed.run, gloo); 2 ranks
x 1 pack per step equal 1 rank x grad_accum 2 on the same packs; a checkpoint resumes on the other number of
ranks over exactly the packs not yet trained (its data position is global), ending at the same weights.

FSDP (train.strategy=fsdp: FSDP2 full shard, DCP checkpoints) trains to DDP's weights and resumes exactly.

One store (tiny); every run is its own process on its own run dir with that store copied in:
  A: 2 ranks, grad_accum 1 (uninterrupted, checkpoints every 2 steps)
  B: A's step-4 checkpoint resumed on 1 rank, grad_accum 2: its last 4 steps, 1 rank x 2 accumulation steps,
     equal A's on 2 ranks x 1
  E: as A under FSDP
  H: 2 ranks x grad_accum 2 under FSDP    I: H's step-4 checkpoint resumed on 4 ranks under FSDP (DCP
  reshards).
Runs that do not wait for each other run two at a time (A with H, B with E): each process spends seconds
importing, time a second run fills on this 2-core machine. Paths not run separately (#48): 1 rank x
grad_accum 2 from the start (B takes it for the last 4 steps), an FSDP checkpoint resumed on the same ranks
(I resumes one on other ranks), a 1-rank checkpoint resumed on 2 ranks (B in the other direction, I on more
ranks)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from pipeline.runner import run_stages

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
COMMON = [
    "+experiment=tiny",
    "data.limit=40",
    "train.max_steps=8",
    "train.save_every_steps=2",
    "train.keep_last=10",
    "train.val_every_steps=1000",
    "train.device=cpu",
    "eval.num_prompts=2",
]


def _train(run_dir: Path, cache_dir: str, ranks: int, grad_accum: int, *extra: str) -> subprocess.Popen:
    """Started, not waited for: `_done` waits."""
    accelerate = str(
        Path(sys.executable).parent / "accelerate"
    )  # the CLI users type (its `launch` subcommand)
    head = (
        [accelerate, "launch", "--cpu", "--num_processes", str(ranks), "-m"]
        if ranks > 1
        else [sys.executable, "-m"]
    )
    cmd = head + [
        "pipeline",
        *COMMON,
        *extra,
        f"train.grad_accum={grad_accum}",
        "stage=train",
        f"run_dir={run_dir}",
        f"cache_dir={cache_dir}",
    ]
    out = open(run_dir.parent / f"{run_dir.name}.out", "w+")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
    proc.log = out
    return proc


def _done(*procs: subprocess.Popen) -> list[subprocess.CompletedProcess]:
    """Each run waited for; its output (stdout and stderr together) as stdout and stderr of the result."""
    results = []
    for p in procs:
        p.wait(timeout=900)
        p.log.seek(0)
        text = p.log.read()
        p.log.close()
        assert p.returncode == 0, text[-3000:]
        results.append(subprocess.CompletedProcess(p.args, p.returncode, text, text))
    return results


def _copy_inputs(src: Path, dst: Path, checkpoint: str | None = None) -> Path:
    dst.mkdir(parents=True)
    for name in ("prepared", "features", "vocab"):
        shutil.copytree(src / name, dst / name)
    if checkpoint:  # as if killed right after that checkpoint
        shutil.copytree(src / "train" / checkpoint, dst / "train" / checkpoint)
    return dst


def _final(run_dir: Path) -> dict:
    return load_file(str(run_dir / "train" / "final" / "model.safetensors"))


def _close(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def runs(make_cfg, tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("ranks")
    store = root / "store"
    for stage in ("prepare", "extract", "vocab"):
        run_stages(make_cfg(*COMMON, f"stage={stage}", run_dir=store))
    a, e, h = (_copy_inputs(store, root / x) for x in "AEH")
    fsdp = "train.strategy=fsdp"
    logs = dict(zip("AH", _done(_train(a, cache_dir, 2, 1), _train(h, cache_dir, 2, 2, fsdp))))
    b = _copy_inputs(a, root / "B", "step_000004")
    i = _copy_inputs(h, root / "I", "step_000004")
    logs |= zip("BE", _done(_train(b, cache_dir, 1, 2), _train(e, cache_dir, 2, 1, fsdp)))
    (logs["I"],) = _done(_train(i, cache_dir, 4, 1, fsdp))
    return {"A": a, "B": b, "E": e, "H": h, "I": i, "store": store, "logs": logs}


def test_accelerate_launch_cpu_with_two_processes_trains_on_two_ranks(runs):
    summary = json.loads((runs["A"] / "train" / "final" / "train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["optimizer_steps"] == 8
    assert "starting the 2 CPU ranks" in runs["logs"]["A"].stderr
    assert json.loads((runs["B"] / "train" / "final" / "train_summary.json").read_text())["world_size"] == 1


def test_a_checkpoint_of_two_ranks_resumes_on_one_with_two_accumulation_steps_to_the_same_weights(runs):
    log = runs["logs"]["B"].stdout
    assert "train: resumed from" in log and "on 1 rank(s) (it was written by 2)" in log, log[-2000:]
    state = json.loads((runs["A"] / "train" / "step_000004" / "train_state.json").read_text())
    assert (
        state["world_size"] == 2 and state["packs_done_in_epoch"] == 8
    )  # 4 steps x 2 packs, a global position
    assert _close(_final(runs["B"]), _final(runs["A"])) <= 1e-5


def test_fsdp_trains_to_the_ddp_weights_and_writes_the_same_final_checkpoint(runs):
    assert (
        "FSDP2, every parameter sharded over 2 ranks" in runs["logs"]["E"].stderr + runs["logs"]["E"].stdout
    )
    assert (
        runs["E"] / "train" / "step_000004" / "dcp" / ".metadata"
    ).is_file()  # sharded, not accelerate's state
    summary = json.loads((runs["E"] / "train" / "final" / "train_summary.json").read_text())
    assert summary["strategy"] == "fsdp" and summary["world_size"] == 2
    ddp, sharded = _final(runs["A"]), _final(runs["E"])
    assert {k: (v.dtype, v.shape) for k, v in ddp.items()} == {
        k: (v.dtype, v.shape) for k, v in sharded.items()
    }
    assert _close(ddp, sharded) <= 1e-5  # the same serving checkpoint: export reads train/final/ alone


def test_an_fsdp_checkpoint_resumes_on_twice_the_ranks_at_the_same_weights(runs):
    """A preempted cluster job comes back on another node count: the sharded (DCP) checkpoint of 2 ranks x 2
    accumulation steps resumes on 4 ranks x 1 over the packs not yet trained, to the uninterrupted weights."""
    log = runs["logs"]["I"].stdout + runs["logs"]["I"].stderr
    assert "train: resumed from" in log and "step_000004 (step 4" in log, log[-2000:]
    assert "on 4 rank(s) (it was written by 2)" in log, log[-2000:]
    assert "FSDP2, every parameter sharded over 4 ranks" in log, log[-2000:]
    assert _close(_final(runs["I"]), _final(runs["H"])) <= 1e-5


def test_fsdp_on_one_rank_and_a_ddp_checkpoint_under_fsdp_are_refused_in_one_line(
    runs, make_cfg, tmp_path, cache_dir
):
    from pipeline.errors import UserError

    one = _copy_inputs(runs["store"], tmp_path / "one")
    with pytest.raises(
        UserError, match="train.strategy=fsdp shards the draft over several ranks; this run has one"
    ):
        run_stages(make_cfg(*COMMON, "train.strategy=fsdp", "stage=train", run_dir=one))
    ddp_ckpt = _copy_inputs(runs["store"], tmp_path / "ddp", None)
    shutil.copytree(runs["A"] / "train" / "step_000004", ddp_ckpt / "train" / "step_000004")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "pipeline",
            *COMMON,
            "train.strategy=fsdp",
            "stage=train",
            f"run_dir={ddp_ckpt}",
            f"cache_dir={cache_dir}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0 and "was trained on other inputs or another train config" in r.stderr, r.stderr[
        -2000:
    ]
