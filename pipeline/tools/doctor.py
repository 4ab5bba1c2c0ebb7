"""`eaglepipe doctor export_dir=... launch_file=serve.sh` (or `launch_file=- < serve.sh`, or
`launch='python -m sglang.launch_server ...'`; a vLLM line alike), or
`eaglepipe doctor export_dir=... server=http://host:port` for a running SGLang server (its /server_info).

Reads a server launch line and the export it should serve, and flags each seed failure with a one-line fix:
EAGLE instead of EAGLE3, a draft path that is not this export, aux ids missing or different, the other
engine's layout, absolute-id d2t, fc width inconsistent with the aux count (the last ones via check_export).
"""

from __future__ import annotations

import json
import logging
import shlex
import sys
from pathlib import Path

from pipeline.engines.verify import check_export, export_architecture, read_export
from pipeline.errors import UserError
from pipeline.models import targets

log = logging.getLogger(__name__)


def parse_launch(line: str) -> dict:
    """engine, algorithm, draft path from an SGLang or vLLM launch line."""
    argv = shlex.split(line)
    opts, i = {}, 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--"):
            key, _, val = a[2:].partition("=")
            if not val and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                val, i = argv[i + 1], i + 1
            opts[key.replace("_", "-")] = val
        i += 1
    engine = launched_engine(argv)
    if engine == "sglang":
        return {
            "engine": "sglang",
            "algorithm": opts.get("speculative-algorithm"),
            "draft": opts.get("speculative-draft-model-path"),
        }
    if engine == "vllm":
        try:
            spec = json.loads(opts.get("speculative-config") or "{}")
        except json.JSONDecodeError as e:
            raise UserError(
                f"--speculative-config is not JSON ({e.msg} at char {e.pos}): "
                f"{opts.get('speculative-config')!r}"
            ) from None
        return {"engine": "vllm", "algorithm": spec.get("method"), "draft": spec.get("model")}
    raise UserError("launch line names neither sglang nor vllm")


def launched_engine(argv: list[str]) -> str | None:
    """The engine a launch line starts, read from the program (the words before its first --option), never
    from paths among the arguments: a vLLM line whose draft path contains "sglang" is still vLLM."""
    program = []
    for a in argv:
        if a.startswith("--"):
            break
        if not a.startswith(
            "-"
        ):  # interpreter flags before -m (`python -u -m sglang.launch_server`) are skipped
            program.append(a)
    for word in program:
        name = word.rsplit("/", 1)[-1]
        if name == "sglang" or name.startswith("sglang."):
            return "sglang"
        if name == "vllm" or name.startswith("vllm."):
            return "vllm"
    return None


def launched_target(line: str) -> str | None:
    """The target a launch line serves: --model-path / --model (SGLang, vLLM's module entry point), or the
    word after `vllm serve`."""
    argv = shlex.split(line)
    for i, a in enumerate(argv):
        key, eq, value = a.partition("=")
        if key.replace("_", "-") in ("--model-path", "--model"):
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    program = argv[: next((i for i, a in enumerate(argv) if a.startswith("--")), len(argv))]
    if "serve" in program and program.index("serve") + 1 < len(program):
        return program[program.index("serve") + 1]
    return None


def same_target(path: str, manifest: dict) -> bool:
    """`path` is the export's target: the same folder, or a folder of the same content (its fingerprint)."""
    folder, own = Path(path).expanduser(), Path(manifest["target_path"])
    if folder.resolve() == own.resolve():
        return True
    return (folder / "config.json").is_file() and targets.fingerprint(folder) == manifest.get(
        "target_fingerprint"
    )


def read_server(url: str) -> dict:
    """engine, algorithm, draft path of a RUNNING SGLang server, from its resolved server args
    (`GET /server_info`, the older `/get_server_info`: sglang/srt/utils/common.py::build_server_info)."""
    import httpx

    from pipeline.serving.endpoint import answer_json, shown

    url = url.rstrip("/")
    try:
        for path in ("/server_info", "/get_server_info"):
            r = httpx.get(url + path, timeout=30)
            if r.status_code == 200:
                info = answer_json(r, url, f"GET {path}")  # not UTF-8, not JSON: one line
                if not isinstance(info, dict):
                    raise UserError(f"doctor: {url}: GET {path} answered {shown(r.content)}, not an object")
                return {
                    "engine": "sglang",
                    "algorithm": info.get("speculative_algorithm"),
                    "draft": info.get("speculative_draft_model_path"),
                    "target": info.get("model_path"),
                }
    except httpx.HTTPError as e:
        raise UserError(f"doctor: {url}: {type(e).__name__}: {e}; is the server running?") from None
    raise UserError(
        f"doctor: {url} has no /server_info or /get_server_info: not an SGLang server "
        "(for vLLM pass its launch line: launch='vllm serve ...')"
    )


def diagnose(export_dir: Path, line: str | None = None, server: str | None = None) -> list[str]:
    export_dir = Path(export_dir)
    manifest, facts = read_export(export_dir)
    launch = read_server(server) if server else parse_launch(line)
    findings = []
    algo = (launch["algorithm"] or "").upper()
    if algo != "EAGLE3":
        flag = "--speculative-algorithm EAGLE3" if launch["engine"] == "sglang" else '"method": "eagle3"'
        findings.append(
            f"speculative algorithm is {launch['algorithm']!r}, not EAGLE3: the aux hidden states are "
            f"never captured and fc is bypassed -> use {flag}"
        )
    if not launch["draft"] or Path(launch["draft"]).resolve() != export_dir.resolve():
        findings.append(f"the draft path {launch['draft']!r} is not this export -> point it at {export_dir}")
    served = launch.get("target") if server else launched_target(line)
    if served and not same_target(served, manifest):
        flag = "--model-path " if launch["engine"] == "sglang" else "vllm serve "
        findings.append(
            f"the server's target {served!r} is not the export's target {manifest['target_path']} (the draft "
            f"was trained on its hidden states) -> {flag}{manifest['target_path']}"
        )
    if manifest["engine"] != launch["engine"]:
        findings.append(
            f"this export is in {manifest['engine']}'s layout but the line starts {launch['engine']} -> "
            f"use {export_dir.parent / launch['engine']}"
        )
    findings += [
        f"{p} -> re-export with `eaglepipe stage=export run_dir={manifest['run_dir']}`"
        for p in check_export(export_dir, manifest["engine"], facts, export_architecture(manifest))
    ]
    return findings


def launch_line(cfg) -> str | None:
    """The launch line: `launch=`, or the file `launch_file=` names (serve.sh; `-`: standard input), read as
    the shell reads a one-command script: comment lines out, backslash-newline continuations joined. A file
    needs no quoting, whatever quotes, spaces or JSON the line holds."""
    if cfg.get("launch_file") is None:
        return cfg.launch
    if cfg.launch:
        raise UserError("doctor: launch= and launch_file= are both set; keep one")
    if cfg.launch_file == "-":
        where, text = "standard input", sys.stdin.read()
    else:
        path = Path(cfg.launch_file).expanduser()
        if not path.is_file():
            raise UserError(f"doctor: launch_file={path} is not a file; give serve.sh's path or - (stdin)")
        where, text = str(path), path.read_text(encoding="utf-8-sig", errors="replace")
    text = text.replace("\\\n", " ")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    if len(lines) != 1:
        raise UserError(
            f"doctor: {where} holds {len(lines)} command lines; it reads one launch line (as serve.sh holds)"
        )
    return lines[0]


def run(cfg) -> Path:
    line = launch_line(cfg)
    if not cfg.export_dir or not (line or cfg.server):
        raise UserError(
            "doctor needs export_dir=<export folder> and the launch line: launch_file=<serve.sh> (or "
            "launch_file=- < serve.sh), launch='<line>', or server=http://host:port (a running SGLang server)"
        )
    findings = diagnose(Path(cfg.export_dir), line, cfg.server)
    for f in findings:
        print(f"doctor: {f}")
    if findings:
        raise UserError(f"{len(findings)} problem(s) between {cfg.export_dir} and the launch line")
    print("doctor: the launch line serves this export with EAGLE3 and the right layout")
    return Path(cfg.export_dir)
