"""An export's launch lines and the one writer of its serve.sh and the manifest's `serve` record.

`serve_command` builds the line export writes into serve.sh (from the export's target path and the serve
settings: num_steps, topk, num_draft_tokens, sglang_args, vllm_args); `write_serve` writes serve.sh and, when
the folder has one, export_manifest.json's `serve` (the settings and how they were chosen: `{"by": "config"}`
at export, `{"by": "measurement", "table": ...}` from `eaglepipe tune-serve`). Export and tune-serve both call
it.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from pipeline.formats import export_layouts as lay

SGLANG_PROGRAM = ["python", "-m", "sglang.launch_server"]
SPEC_KEYS = ("num_steps", "topk", "num_draft_tokens")


def settings(serve) -> dict:
    """The serve settings as a plain dict (export.serve's DictConfig, a manifest's record, a sweep
    candidate)."""
    d = dict(serve)
    return {
        "num_steps": int(d["num_steps"]),
        "topk": int(d["topk"]),
        "num_draft_tokens": int(d["num_draft_tokens"]),
        "sglang_args": [str(a) for a in d.get("sglang_args") or []],
        "vllm_args": [str(a) for a in d.get("vllm_args") or []],
    }


def serve_command(engine: str, target: str, export: Path, serve) -> str:
    """The launch line, every path and the JSON shell-quoted (a run dir with a space stays one argument)."""
    s = settings(serve)
    extra = s[f"{engine}_args"]
    tail = (" " + shlex.join(extra)) if extra else ""
    target, draft = shlex.quote(str(target)), shlex.quote(str(export))
    if engine == "sglang":
        return (
            f"python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {draft} --speculative-num-steps {s['num_steps']} "
            f"--speculative-eagle-topk {s['topk']} --speculative-num-draft-tokens {s['num_draft_tokens']} "
            f"--dtype bfloat16{tail}"
        )
    spec = json.dumps({"method": "eagle3", "model": str(export), "num_speculative_tokens": s["num_steps"]})
    return f"vllm serve {target} --speculative-config {shlex.quote(spec)} --dtype bfloat16{tail}"


def plain_command(target: str, serve) -> str:
    """The same SGLang server without speculation: the baseline a speedup is measured against."""
    extra = settings(serve)["sglang_args"]
    return f"python -m sglang.launch_server --model-path {shlex.quote(str(target))} --dtype bfloat16" + (
        (" " + shlex.join(extra)) if extra else ""
    )


def with_flag(args: list[str], flag: str, value) -> list[str]:
    """args with `flag value` set: an existing `flag v` / `flag=v` replaced, else appended; value None: as
    is."""
    if value is None:
        return list(args)
    out, i = [], 0
    while i < len(args):
        if args[i] == flag:
            i += 2
            continue
        if args[i].startswith(flag + "="):
            i += 1
            continue
        out.append(args[i])
        i += 1
    return out + [flag, str(value)]


def flag_value(line: str, flag: str) -> str | None:
    argv = shlex.split(line)
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def argv_of(line: str, prefix: str | None, extra: list[str]) -> list[str]:
    """A launch line as argv, its program (the words before the first --option) replaced by `prefix` if given,
    `extra` flags (a port, the sweep's server_args) appended."""
    argv = shlex.split(line)
    first = next((i for i, a in enumerate(argv) if a.startswith("--")), len(argv))
    program = shlex.split(prefix) if prefix else argv[:first]
    return [*program, *argv[first:], *[str(a) for a in extra]]


def write_serve(
    folder: Path, engine: str, target: str, draft: Path, serve, chosen_by: dict, manifest: dict | None = None
) -> dict:
    """serve.sh (executable) of the export in `folder`, and the manifest's `serve` record: into `manifest` if
    given (export, before it writes the manifest), else into folder/export_manifest.json if it exists."""
    (folder / "serve.sh").write_text(serve_command(engine, target, draft, serve) + "\n")
    os.chmod(folder / "serve.sh", 0o755)
    record = {**settings(serve), "chosen_by": chosen_by}
    if manifest is not None:
        manifest["serve"] = record
    elif (folder / lay.MANIFEST).is_file():
        path = folder / lay.MANIFEST
        data = json.loads(path.read_text())
        data["serve"] = record
        if "files" in data:  # the sha256 the export recorded for serve.sh: this one's now
            lay.record_files(folder, data, ("serve.sh",))
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    return record
