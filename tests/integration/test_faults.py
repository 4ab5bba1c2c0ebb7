"""Fault injection (#12 item 6): SIGKILL at seeded random points of prepare, extract, train and export, then
the same command again: every stage's output equals an uninterrupted run's, byte for byte (content, not
timings).

Each kill point is drawn uniformly over the stage's own wall time in the reference run (process start
included, so some kills land in start-up, some mid-work, some while committing). The whole process group is
killed, as a cluster scheduler does. EAGLEPIPE_FAULT_POINTS sets the points per stage: 1 in CI (the time
budget), 20 for the issue's full run: `EAGLEPIPE_FAULT_POINTS=20 pytest tests/integration/test_faults.py`. The
last test lets the regeneration server die mid-way through prepare (`prepare.regenerate_endpoint`).
"""

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
POINTS = int(os.environ.get("EAGLEPIPE_FAULT_POINTS", "1"))
STAGES = ["prepare", "extract", "vocab", "train", "export"]
KILLED = ["prepare", "extract", "train", "export"]


def cli(run_dir: Path, cache_dir, stage: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pipeline",
        f"stage={stage}",
        "+experiment=tiny",
        "data.limit=12",
        f"run_dir={run_dir}",
        f"cache_dir={cache_dir}",
        "extract.shard_tokens=2500",
        "extract.batch_tokens=600",
        "train.max_steps=8",
        "train.save_every_steps=2",
        "train.val_every_steps=1000",
        "export.verify_in_engine=false",
    ]


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def digest(run_dir: Path, stage: str) -> str:
    """What a stage produced, independent of when: the content of its artefact."""
    h = hashlib.sha256()
    if stage == "prepare":
        from pipeline.formats import prepared

        ds, stats = prepared.load(run_dir)
        for col in ("input_ids", "loss_mask", "sample_id", "source_id"):
            h.update(json.dumps(list(ds[col])).encode())
        h.update(json.dumps({k: v for k, v in stats.items() if "second" not in k}, sort_keys=True).encode())
    elif stage == "extract":
        from pipeline.formats.feature_store import FeatureStore

        store = FeatureStore(run_dir / "features")
        h.update(json.dumps(store.facts, sort_keys=True, default=str).encode())
        for i in range(len(store)):
            for k, v in sorted(store.sample(i).items()):
                h.update(k.encode() + _bytes(v))
    elif stage == "train":
        for k, v in sorted(load_file(str(run_dir / "train" / "final" / "model.safetensors")).items()):
            h.update(k.encode() + _bytes(v))
    elif stage == "export":
        folder = run_dir / "export" / "sglang"
        h.update((folder / "model.safetensors").read_bytes() + (folder / "config.json").read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir):
    """The uninterrupted run, stage by stage: (run_dir, wall seconds per stage, digest per stage)."""
    ref = tmp_path_factory.mktemp("faults") / "ref"
    walls, digests = {}, {}
    for stage in STAGES:
        t0 = time.time()
        r = subprocess.run(cli(ref, cache_dir, stage), cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        walls[stage] = time.time() - t0
        digests[stage] = digest(ref, stage) if stage in KILLED else None
    return ref, walls, digests


def state_before(ref: Path, stage: str, dst: Path) -> None:
    """A copy of the reference run as it was before `stage` ran: its and later stages' outputs gone."""
    later = STAGES[STAGES.index(stage) :]
    folders = {
        "prepare": "prepared",
        "extract": "features",
        "vocab": "vocab",
        "train": "train",
        "export": "export",
    }
    shutil.copytree(
        ref,
        dst,
        ignore=lambda d, names: [
            n for n in names if Path(d) == ref and n in {folders[s] for s in later} | {"eval"}
        ],
    )
    records = json.loads((dst / "stages.json").read_text())
    (dst / "stages.json").write_text(json.dumps({k: v for k, v in records.items() if k not in later}))


@pytest.mark.parametrize("stage", KILLED)
def test_sigkill_at_random_points_then_rerun_gives_the_uninterrupted_output(
    reference, tmp_path, cache_dir, stage
):
    ref, walls, digests = reference
    rng = random.Random(f"eaglepipe-faults-{stage}")
    killed_mid_run = 0
    for point in range(POINTS):
        run_dir = tmp_path / f"p{point}"
        state_before(ref, stage, run_dir)
        delay = rng.uniform(0.2, 0.8 * walls[stage])  # the rerun may be faster than the reference was
        proc = subprocess.Popen(
            cli(run_dir, cache_dir, stage),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            killed_mid_run += 1
        again = subprocess.run(cli(run_dir, cache_dir, stage), cwd=ROOT, capture_output=True, text=True)
        assert again.returncode == 0, f"point {point} (kill after {delay:.1f} s): {again.stderr[-3000:]}"
        assert digest(run_dir, stage) == digests[stage], f"{stage}: point {point}, killed after {delay:.1f} s"
        shutil.rmtree(run_dir)
    assert killed_mid_run >= (1 if POINTS >= 2 else 0), (
        f"{stage}: every process finished before its kill point"
    )


class _DyingChatServer(BaseHTTPRequestHandler):
    """TEST SERVER (external boundary): OpenAI chat completions over real HTTP. After `die_after` answers it
    drops the connection and is gone (stops serving and closes its socket), as a crashed server is."""

    answered = 0
    die_after = None
    server = None

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        if cls.die_after is not None and cls.answered >= cls.die_after:
            self.close_connection = True  # no response: "server disconnected", then connections refused
            threading.Thread(
                target=lambda: (cls.server.shutdown(), cls.server.server_close()), daemon=True
            ).start()
            return
        cls.answered += 1
        data = json.dumps(
            {
                "choices": [
                    {
                        "message": {
                            "role": "assistant",
                            "content": f"reply to: {body['messages'][-1]['content'][:20]}",
                        }
                    }
                ]
            }
        )
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data.encode())

    def log_message(self, *args):
        pass


def _serve(die_after):
    handler = type("Handler", (_DyingChatServer,), {"answered": 0, "die_after": die_after})
    handler.server = HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=handler.server.serve_forever, daemon=True).start()
    return handler.server


def test_regeneration_server_dying_mid_way_is_one_line_then_a_rerun_equals_an_uninterrupted_run(
    make_cfg, tmp_path
):
    from pipeline.errors import UserError
    from pipeline.formats import prepared
    from pipeline.runner import run_stages

    def cfg(run_dir, server):
        return make_cfg(
            "target=tiny",
            "data.limit=6",
            "stage=prepare",
            "prepare.regenerate=true",
            "prepare.endpoint_concurrency=1",
            "prepare.endpoint_timeout_s=10",
            "prepare.endpoint_backoff_s=0.01",
            f"prepare.regenerate_endpoint=http://127.0.0.1:{server.server_port}",
            run_dir=run_dir,
        )

    healthy = _serve(None)
    run_stages(cfg(tmp_path / "ref", healthy))
    healthy.shutdown()
    dying = _serve(7)
    with pytest.raises(
        UserError, match="regenerate endpoint .*is the server running.*rerun the same command to resume"
    ):
        run_stages(cfg(tmp_path / "b", dying))
    assert not (tmp_path / "b" / "prepared" / "stats.json").exists()  # nothing half-written is published
    again = _serve(None)
    run_stages(cfg(tmp_path / "b", again))  # the same run dir, the server back (on another port)
    again.shutdown()
    (a, _), (b, _) = prepared.load(tmp_path / "ref"), prepared.load(tmp_path / "b")
    for col in ("input_ids", "loss_mask", "sample_id", "source_id"):
        assert list(a[col]) == list(b[col]), col
