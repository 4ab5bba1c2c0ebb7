"""`eaglepipe tune-serve`: the sweep (pipeline/serving/sweep.py) starts each candidate as an SGLang-like test
server script (tests/sglang_like_server.py, through tune.launch_prefix: the true external boundary) whose
speed depends on its settings, and writes the fastest valid one into the export's serve.sh and manifest with
the writer
export uses."""

import json
import os
import sys
from pathlib import Path

import pytest

from pipeline.errors import UserError
from pipeline.serving import launch, sweep
from pipeline.tools import tune_serve

SCRIPT = Path(__file__).resolve().parents[1] / "sglang_like_server.py"
PROMPTS = [[1, 2], [3], [4, 5, 6]]
TARGET = "/models/the-target"


@pytest.fixture
def export(tmp_path):
    """An SGLang export folder as export writes serve.sh and the manifest's serve record (no weights: the test
    servers load none)."""
    folder = tmp_path / "run" / "export" / "sglang"
    folder.mkdir(parents=True)
    manifest = {"engine": "sglang", "target_path": TARGET}
    serve = {
        "num_steps": 3,
        "topk": 1,
        "num_draft_tokens": 4,
        "sglang_args": ["--attention-backend", "triton"],
    }
    launch.write_serve(folder, "sglang", TARGET, folder, serve, {"by": "config"}, manifest)
    (folder / "export_manifest.json").write_text(json.dumps(manifest))
    return folder


def tune_cfg(make_cfg, tmp_path, behaviour: dict, *overrides):
    (tmp_path / "behaviour.json").write_text(json.dumps(behaviour))
    cfg = make_cfg(
        "eval.concurrency=[1,2]",
        "eval.repeats=2",
        "eval.warmup_prompts=1",
        "eval.max_new_tokens=8",
        "tune.start_timeout_s=30",
        *overrides,
        run_dir=tmp_path / "run",
    )
    cfg.tune.launch_prefix = f"{sys.executable} {SCRIPT} --behaviour {tmp_path / 'behaviour.json'}"
    return cfg


def gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_faster_settings_win_and_land_in_serve_sh_and_the_manifest(make_cfg, tmp_path, export):
    cfg = tune_cfg(
        make_cfg,
        tmp_path,
        {"plain": {"delay_s": 0.02}, "1": {"delay_s": 0.08}, "2": {"delay_s": 0.002}, "3": {"delay_s": 0.04}},
        "tune.grid.num_steps=[1,2,3]",
    )
    path = tune_serve.tune(cfg, export, PROMPTS)
    table = json.loads(path.read_text())
    assert path == tmp_path / "run" / "tune" / "serve_sweep.json"
    assert [r["status"] for r in table["candidates"]] == ["ok", "ok", "ok"]
    assert table["candidates"][table["winner"]]["settings"]["num_steps"] == 2
    assert table["candidates"][1]["speedup"] > 1 > table["candidates"][0]["speedup"]
    line = (export / "serve.sh").read_text()
    assert (
        "--speculative-num-steps 2 --speculative-eagle-topk 1 --speculative-num-draft-tokens 3" in line
        and "--attention-backend triton" in line
        and "--port" not in line
        and str(SCRIPT) not in line
    )
    assert line == launch.serve_command("sglang", TARGET, export, table["candidates"][1]["serve"]) + "\n"
    serve = json.loads((export / "export_manifest.json").read_text())["serve"]
    assert (serve["num_steps"], serve["topk"], serve["num_draft_tokens"]) == (2, 1, 3)
    assert serve["chosen_by"]["by"] == "measurement" and serve["chosen_by"]["table"] == str(path.resolve())
    assert serve["chosen_by"]["tokens_per_s"] == table["candidates"][1]["tokens_per_s"]
    launched = [r["launch"] for r in table["candidates"]] + [table["baseline"]["launch"]]
    assert all(a[:2] == [sys.executable, str(SCRIPT)] and "--port" in a for a in launched)
    assert "--speculative-algorithm" not in table["baseline"]["launch"]


def test_a_server_that_fails_at_start_or_dies_mid_sweep_is_reported_and_never_chosen(
    make_cfg, tmp_path, export
):
    cfg = tune_cfg(
        make_cfg,
        tmp_path,
        {
            "plain": {"delay_s": 0.005},
            "1": {"fail_at_start": True},
            "2": {"delay_s": 0.001, "die_after": 5},
            "3": {"delay_s": 0.02},
        },
        "tune.grid.num_steps=[1,2,3]",
    )
    table = json.loads(tune_serve.tune(cfg, export, PROMPTS).read_text())
    rows = table["candidates"]
    assert [r["status"] for r in rows] == ["failed at start", "died mid-bench", "ok"]
    assert "exited with code 1" in rows[0]["reason"] and "not enough memory" in rows[0]["reason"]
    assert "the speculative server" in rows[1]["reason"] and "stopped answering" in rows[1]["reason"]
    assert "speedup" not in rows[1]["report"]
    assert table["winner"] == 2
    assert "--speculative-num-steps 3" in (export / "serve.sh").read_text()


def test_no_valid_candidate_leaves_serve_sh_as_it_was(make_cfg, tmp_path, export):
    before = (export / "serve.sh").read_text()
    cfg = tune_cfg(make_cfg, tmp_path, {"1": {"fail_at_start": True}}, "tune.grid.num_steps=[1]")
    with pytest.raises(
        UserError, match="no candidate started and completed its bench.*serve.sh is unchanged"
    ):
        tune_serve.tune(cfg, export, PROMPTS)
    assert (export / "serve.sh").read_text() == before
    assert json.loads((export / "export_manifest.json").read_text())["serve"]["chosen_by"] == {"by": "config"}


def test_a_candidate_reporting_other_settings_than_asked_is_not_chosen(make_cfg, tmp_path, export):
    cfg = tune_cfg(
        make_cfg,
        tmp_path,
        {"1": {"delay_s": 0.001, "reports": {"speculative_num_draft_tokens": 9}}, "2": {"delay_s": 0.01}},
        "tune.grid.num_steps=[1,2]",
    )
    table = json.loads(tune_serve.tune(cfg, export, PROMPTS).read_text())
    assert table["candidates"][0]["status"] == "ran other settings"
    assert "num_draft_tokens=9 (asked 2)" in table["candidates"][0]["reason"] and table["winner"] == 1


def test_a_speculative_baseline_stops_the_sweep_in_one_line(make_cfg, tmp_path, export):
    """tune.baseline_endpoint that speculates: refused once (not like for like), nothing chosen."""
    import subprocess

    from pipeline.serving import server

    (tmp_path / "behaviour.json").write_text("{}")
    port = server.free_port()
    srv, reason = server.start(
        [
            sys.executable,
            str(SCRIPT),
            "--behaviour",
            str(tmp_path / "behaviour.json"),
            "--port",
            str(port),
            "--model-path",
            TARGET,
            "--speculative-algorithm",
            "EAGLE3",
        ],
        port,
        tmp_path / "spec_baseline.log",
        30,
    )
    assert reason is None
    try:
        cfg = tune_cfg(
            make_cfg, tmp_path, {}, "tune.grid.num_steps=[1,2]", f"tune.baseline_endpoint={srv.url}"
        )
        with pytest.raises(UserError, match="is itself speculative.*table so far") as e:
            tune_serve.tune(cfg, export, PROMPTS)
        assert "\n" not in str(e.value)
        assert json.loads((export / "export_manifest.json").read_text())["serve"]["chosen_by"] == {
            "by": "config"
        }
    finally:
        server.stop(srv)
    assert gone(srv.pgid) and isinstance(srv.proc, subprocess.Popen)


def test_servers_are_stopped_by_their_own_process_group(tmp_path):
    from pipeline.serving import server

    (tmp_path / "b.json").write_text("{}")
    port = server.free_port()
    srv, reason = server.start(
        [
            sys.executable,
            str(SCRIPT),
            "--behaviour",
            str(tmp_path / "b.json"),
            "--port",
            str(port),
            "--model-path",
            TARGET,
        ],
        port,
        tmp_path / "s.log",
        30,
    )
    assert reason is None and os.getpgid(srv.proc.pid) == srv.pgid != os.getpgid(0)
    server.stop(srv)
    assert gone(srv.pgid) and srv.proc.returncode is not None


def test_the_grid_is_every_combination_with_sglangs_topk_1_rule():
    grid = {
        "num_steps": [1, 3],
        "topk": [1, 4],
        "num_draft_tokens": [None, 8],
        "attention_backend": [None],
        "cuda_graph_max_bs": [None, 16],
    }
    cands, skipped = sweep.candidates(grid)
    assert {(c["num_steps"], c["topk"], c["num_draft_tokens"]) for c in cands} == {
        (1, 1, 2),
        (3, 1, 4),
        (1, 4, 2),
        (1, 4, 8),
        (3, 4, 4),
        (3, 4, 8),
    }
    assert len(cands) == 12 and all(
        s["settings"]["topk"] == 1 and s["settings"]["num_draft_tokens"] == 8 for s in skipped
    )
    base = {
        "num_steps": 3,
        "topk": 1,
        "num_draft_tokens": 4,
        "sglang_args": ["--attention-backend=triton", "--x", "1"],
        "vllm_args": [],
    }
    c = {"num_steps": 2, "topk": 1, "num_draft_tokens": 3, "attention_backend": "fa3", "cuda_graph_max_bs": 8}
    assert sweep.serve_of(base, c)["sglang_args"] == [
        "--x",
        "1",
        "--attention-backend",
        "fa3",
        "--cuda-graph-max-bs",
        "8",
    ]
    assert sweep.serve_of(base, {**c, "attention_backend": None})["sglang_args"][:3] == [
        "--attention-backend=triton",
        "--x",
        "1",
    ]


def test_tune_serve_checks_name_the_fix(make_cfg, tmp_path):
    cfg = make_cfg(
        "eval.concurrency=[8]",
        "tune.objective_concurrency=1",
        "tune.grid.num_steps=[]",
        "eval.sets=[mt_bench_turn2]",
        run_dir=tmp_path,
    )
    with pytest.raises(UserError) as e:
        tune_serve.check(cfg)
    msg = str(e.value)
    assert "tune.objective_concurrency=1 is not one of eval.concurrency=[8]" in msg
    assert "tune.grid.num_steps is empty" in msg and "drop mt_bench_turn2" in msg and "\n" not in msg


def test_tune_serve_is_a_tool_that_refuses_a_run_without_an_sglang_export(make_cfg, tmp_path):
    from pipeline.runner import TOOLS, run_stages

    assert "tune_serve" in TOOLS
    with pytest.raises(UserError, match="no SGLang export in .*run stage=export"):
        run_stages(make_cfg("stage=tune_serve", run_dir=tmp_path))
