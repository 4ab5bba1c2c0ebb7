"""doctor.parse_launch: which engine a launch line starts, with which algorithm and draft (issue #12 B6,
B20)."""

import pytest

from pipeline.errors import UserError
from pipeline.tools.doctor import parse_launch


@pytest.mark.parametrize(
    "line,want",
    [
        (
            "python -m sglang.launch_server --model-path /m --speculative-algorithm EAGLE3 "
            "--speculative-draft-model-path /d",
            {"engine": "sglang", "algorithm": "EAGLE3", "draft": "/d"},
        ),
        (
            (
                "CUDA_VISIBLE_DEVICES=0 python3 -m sglang.launch_server --model-path /m "
                "--speculative_algorithm=EAGLE "
                "--speculative-draft-model-path=/d"
            ),
            {"engine": "sglang", "algorithm": "EAGLE", "draft": "/d"},
        ),
        (
            """vllm serve /m --speculative-config '{"method": "eagle3", "model": "/d"}'""",
            {"engine": "vllm", "algorithm": "eagle3", "draft": "/d"},
        ),
        # a vLLM line whose paths say "sglang" is still a vLLM line (it was read as SGLang and given SGLang's
        # fix)
        (
            "vllm serve /models/sglang-target --speculative-config "
            """'{"method": "eagle3", "model": "runs/x/export/sglang"}'""",
            {"engine": "vllm", "algorithm": "eagle3", "draft": "runs/x/export/sglang"},
        ),
        ("/opt/venv/bin/vllm serve /m", {"engine": "vllm", "algorithm": None, "draft": None}),
    ],
)
def test_the_engine_is_read_from_the_program_not_from_paths(line, want):
    assert parse_launch(line) == want


def test_a_non_json_speculative_config_is_one_clear_error():
    with pytest.raises(UserError, match="--speculative-config is not JSON"):
        parse_launch("vllm serve /m --speculative-config '{method: eagle3}'")


def test_a_line_of_neither_engine_is_refused():
    with pytest.raises(UserError, match="neither sglang nor vllm"):
        parse_launch("python serve.py --model /runs/sglang/x")


@pytest.mark.parametrize(
    "line,want",
    [
        # boolean flags take no value: the next option is not swallowed as one
        (
            (
                "python -m sglang.launch_server --model-path /m --trust-remote-code --speculative-algorithm "
                "EAGLE3 "
                "--enable-torch-compile --speculative-draft-model-path /d"
            ),
            {"engine": "sglang", "algorithm": "EAGLE3", "draft": "/d"},
        ),
        # the last spelling of a repeated option wins, as with argparse
        (
            "python -m sglang.launch_server --speculative-algorithm EAGLE --speculative-algorithm EAGLE3",
            {"engine": "sglang", "algorithm": "EAGLE3", "draft": None},
        ),
        # a quoted draft path with spaces stays one path
        (
            "python -m sglang.launch_server --speculative-algorithm EAGLE3 --speculative-draft-model-path "
            "'/my runs/x/export/sglang'",
            {"engine": "sglang", "algorithm": "EAGLE3", "draft": "/my runs/x/export/sglang"},
        ),
        # no speculation at all: nothing to read, and nothing invented
        (
            "python -m sglang.launch_server --model-path /m --tp 2",
            {"engine": "sglang", "algorithm": None, "draft": None},
        ),
        # vLLM's module entry point and the --opt=value spelling of the JSON
        (
            "python -m vllm.entrypoints.openai.api_server --model /m "
            """--speculative-config='{"method":"eagle3","model":"/d"}'""",
            {"engine": "vllm", "algorithm": "eagle3", "draft": "/d"},
        ),
        (
            "/usr/bin/python3.11 -m vllm.entrypoints.openai.api_server "
            """--speculative_config '{"model": "/d"}'""",
            {"engine": "vllm", "algorithm": None, "draft": "/d"},
        ),
    ],
)
def test_options_are_read_like_argparse_reads_them(line, want):
    assert parse_launch(line) == want


def test_interpreter_flags_before_dash_m_do_not_hide_the_engine():
    """`python -u -m sglang.launch_server …` was refused as naming neither engine (found in review, #12)."""
    from pipeline.tools.doctor import parse_launch

    got = parse_launch(
        "python -u -X faulthandler -m sglang.launch_server --model-path /t "
        "--speculative-algorithm EAGLE3 --speculative-draft-model-path /d"
    )
    assert got == {"engine": "sglang", "algorithm": "EAGLE3", "draft": "/d"}
    assert parse_launch("python3 -O -m vllm.entrypoints.openai.api_server --model /t")["engine"] == "vllm"


SERVE = {"num_steps": 3, "topk": 1, "num_draft_tokens": 4}


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("source", ["file", "stdin"])
def test_doctor_reads_serve_sh_of_a_run_dir_with_a_space_from_a_file_or_stdin(
    tmp_path, monkeypatch, engine, source
):
    """serve.sh of a run dir whose path has a space quotes the path (SGLang) or holds JSON (vLLM): Hydra
    cannot parse it as launch=...; launch_file= (or - for standard input) reads it as the shell would."""
    import io

    from omegaconf import OmegaConf

    from pipeline.serving.launch import serve_command
    from pipeline.tools.doctor import launch_line

    draft = tmp_path / "my run" / "export" / engine
    draft.mkdir(parents=True)
    serve_sh = draft / "serve.sh"
    serve_sh.write_text(serve_command(engine, "/models/my target", draft, SERVE) + "\n")
    if source == "stdin":
        monkeypatch.setattr("sys.stdin", io.StringIO(serve_sh.read_text()))
    cfg = OmegaConf.create({"launch": None, "launch_file": "-" if source == "stdin" else str(serve_sh)})
    line = launch_line(cfg)
    assert line == serve_sh.read_text().strip()
    launch = parse_launch(line)
    assert launch == {
        "engine": engine,
        "algorithm": "EAGLE3" if engine == "sglang" else "eagle3",
        "draft": str(draft),
    }


def test_a_launch_file_with_comments_and_continuations_is_one_line_and_two_commands_are_refused(tmp_path):
    from omegaconf import OmegaConf

    from pipeline.tools.doctor import launch_line

    f = tmp_path / "serve.sh"
    f.write_text("#!/bin/sh\n# the draft\npython -m sglang.launch_server \\\n  --model-path /m\n")
    cfg = OmegaConf.create({"launch": None, "launch_file": str(f)})
    assert launch_line(cfg) == "python -m sglang.launch_server    --model-path /m"
    f.write_text("python -m sglang.launch_server --model-path /m\nvllm serve /m\n")
    with pytest.raises(UserError, match="holds 2 command lines; it reads one launch line"):
        launch_line(cfg)
    with pytest.raises(UserError, match="launch= and launch_file= are both set"):
        launch_line(OmegaConf.create({"launch": "x", "launch_file": str(f)}))
    with pytest.raises(UserError, match="is not a file"):
        launch_line(OmegaConf.create({"launch": None, "launch_file": str(tmp_path / "nope.sh")}))
