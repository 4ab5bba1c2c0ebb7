"""doctor flags each launch-line mistake of the seed failure, with its fix."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.tools.doctor import diagnose

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def export_dir(exported_run):
    return exported_run[0] / "export"


def test_the_generated_serve_lines_are_healthy(export_dir):
    for engine in ("sglang", "vllm"):
        assert diagnose(export_dir / engine, (export_dir / engine / "serve.sh").read_text()) == []


@pytest.mark.parametrize(
    "edit,finding",
    [
        (lambda line: line.replace("EAGLE3", "EAGLE"), "not EAGLE3"),
        (lambda line: line.replace("export/sglang", "export/old"), "is not this export"),
    ],
)
def test_sglang_launch_mistakes_are_flagged(export_dir, edit, finding):
    line = edit((export_dir / "sglang" / "serve.sh").read_text())
    assert any(finding in f for f in diagnose(export_dir / "sglang", line))


def test_vllm_layout_given_to_sglang_is_flagged(export_dir):
    line = (export_dir / "sglang" / "serve.sh").read_text().replace("export/sglang", "export/vllm")
    findings = diagnose(export_dir / "vllm", line)
    assert any("vllm's layout but the line starts sglang" in f for f in findings)


def test_vllm_eagle_instead_of_eagle3_and_missing_aux_ids_are_flagged(export_dir, tmp_path):
    import shutil

    bad = tmp_path / "vllm"
    shutil.copytree(export_dir / "vllm", bad)
    c = json.loads((bad / "config.json").read_text())
    c.pop("eagle_aux_hidden_state_layer_ids")
    (bad / "config.json").write_text(json.dumps(c))
    line = (
        (export_dir / "vllm" / "serve.sh")
        .read_text()
        .replace('"eagle3"', '"eagle"')
        .replace(str(export_dir / "vllm"), str(bad))
    )
    findings = diagnose(bad, line)
    assert any("not EAGLE3" in f for f in findings) and any("aux layer ids missing" in f for f in findings)


def test_doctor_cli_exits_2_with_the_findings(export_dir, cache_dir):
    line = (export_dir / "sglang" / "serve.sh").read_text().replace("EAGLE3", "EAGLE")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "stage=doctor",
            f"cache_dir={cache_dir}",
            f"export_dir={export_dir / 'sglang'}",
            f"launch='{line.strip()}'",
            f"run_dir={export_dir}/doc",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "doctor: speculative algorithm is 'EAGLE'" in r.stdout, r.stdout + r.stderr


def test_verify_and_serve_commands_name_the_engine_versions_and_print_the_launch_lines(export_dir, cache_dir):
    run_dir = export_dir.parent
    r = subprocess.run(
        [sys.executable, "-m", "pipeline", "verify", f"cache_dir={cache_dir}", f"run_dir={run_dir}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "loads completely into sglang 0.5.23's own LlamaForCausalLMEagle3" in r.stdout
    assert "loads completely into vllm 0.33.0's own Eagle3LlamaForCausalLM" in r.stdout
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "serve",
            "engine=sglang",
            f"cache_dir={cache_dir}",
            f"run_dir={run_dir}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and "--speculative-algorithm EAGLE3" in r.stdout, r.stdout + r.stderr


def test_verify_of_a_broken_export_exits_2_naming_the_problem(export_dir, cache_dir, mutate, tmp_path):
    import torch

    bad = mutate(
        export_dir / "sglang",
        tmp_path / "sglang",
        tensors=lambda t: {**t, "fc.weight": torch.zeros_like(t["fc.weight"])},
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "verify",
            f"export_dir={bad}",
            f"cache_dir={cache_dir}",
            f"run_dir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "fc.weight is constant" in r.stdout, r.stdout + r.stderr
    assert "eaglepipe: error: 1 of 1 export(s) failed verification" in r.stderr


def test_doctor_reads_a_running_sglang_servers_own_args(export_dir):
    """SGLangServerInfoTestServer: a TEST SERVER answering /server_info with SGLang's resolved-args fields."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    info = {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": str(export_dir / "sglang")}

    class SGLangServerInfoTestServer(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            body = json.dumps(info).encode() if self.path == "/server_info" else b"{}"
            self.send_response(200 if self.path == "/server_info" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), SGLangServerInfoTestServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        findings = diagnose(export_dir / "sglang", server=url)
        assert len(findings) == 1 and "speculative algorithm is 'EAGLE', not EAGLE3" in findings[0]
        info["speculative_algorithm"] = "EAGLE3"
        assert diagnose(export_dir / "sglang", server=url) == []
    finally:
        server.shutdown()


def test_doctor_flags_a_launch_line_or_server_of_another_target_than_the_exports(export_dir, tmp_path):
    """#35: the draft was trained on one target's hidden states; a line or a live server whose --model-path
    is another target is a listed problem naming both. A copy of the same target elsewhere is the same."""
    import shlex
    import shutil
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    target = json.loads((export_dir / "sglang" / "export_manifest.json").read_text())["target_path"]
    same, other = tmp_path / "same copy", tmp_path / "other"
    shutil.copytree(target, same)
    shutil.copytree(target, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rope_theta": 1234.0}))
    want = f"the server's target {str(other)!r} is not the export's target {target} "
    for engine, fix in (("sglang", f"--model-path {target}"), ("vllm", f"vllm serve {target}")):
        line = (export_dir / engine / "serve.sh").read_text()
        assert diagnose(export_dir / engine, line.replace(shlex.quote(target), shlex.quote(str(same)))) == []
        findings = diagnose(export_dir / engine, line.replace(shlex.quote(target), shlex.quote(str(other))))
        assert len(findings) == 1 and findings[0].startswith(want) and findings[0].endswith(fix), findings

    info = {
        "speculative_algorithm": "EAGLE3",
        "speculative_draft_model_path": str(export_dir / "sglang"),
        "model_path": str(other),
    }

    class SGLangServerInfoTestServer(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            body = json.dumps(info).encode() if self.path == "/server_info" else b"{}"
            self.send_response(200 if self.path == "/server_info" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), SGLangServerInfoTestServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        findings = diagnose(export_dir / "sglang", server=f"http://127.0.0.1:{server.server_address[1]}")
        assert len(findings) == 1 and findings[0].startswith(want), findings
    finally:
        server.shutdown()


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_doctor_reads_the_launch_line_of_a_run_dir_with_a_space_from_a_file_or_stdin(
    export_dir, cache_dir, tmp_path, engine
):
    """#50: serve.sh of a run dir whose path has a space: `launch="$(cat serve.sh)"` cannot be parsed by Hydra
    (one line naming launch_file, exit 2); launch_file=serve.sh and launch_file=- < serve.sh both serve."""
    import shutil

    from pipeline.serving.launch import serve_command

    spaced = tmp_path / "my run" / engine
    shutil.copytree(export_dir / engine, spaced)
    manifest = json.loads((spaced / "export_manifest.json").read_text())
    line = serve_command(engine, manifest["target_path"], spaced, manifest["serve"])
    (spaced / "serve.sh").write_text(line + "\n")

    def doctor(*how, stdin=None):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "pipeline",
                "doctor",
                f"cache_dir={cache_dir}",
                f"export_dir={spaced}",
                *how,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            input=stdin,
        )

    for r in (doctor(f"launch_file={spaced / 'serve.sh'}"), doctor("launch_file=-", stdin=line + "\n")):
        assert r.returncode == 0 and "serves this export with EAGLE3" in r.stdout, r.stdout + r.stderr
    for typed in (f"launch={line}", f"launch='{line}'"):  # launch="$(cat serve.sh)", "launch='$(cat ...)'"
        r = doctor(typed)
        errors = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
        assert "launch_file=<serve.sh>" in errors[0] and "launch_file=- < serve.sh" in errors[0]
