"""Will the engine load an export completely? `eaglepipe verify` (pipeline/tools/verify.py) runs these checks;
so does `stage=export` before it publishes an export.

Two layers of checks, both run by `stage=export` before an export is published and again by this command:
1. `check_export` (no engine needed): aux ids present and equal to the feature store's in the engine's
   numbering; fc.in_features == n_aux x target hidden; d2t/t2d invariants (d2t is an OFFSET table);
   every tensor finite and not constant; for SGLang, key names that every SGLang loads (`midlayer.*`), a
   draft_vocab_size, and a replay of its name mapping against its parameter table.
2. `engine_report` (needs .venv-engines, `make setup-engines`): the export goes through the
   engine's OWN model class and OWN `load_weights` on CPU (pipeline/engines/*_verify.py), and the engine's own
   config resolution says which aux layers it will capture. Catches a key the loader drops without a word,
   a parameter never written, a wrong hot_token_id, aux capture switched off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file

from pipeline.errors import UserError
from pipeline.formats import engine_memo, vocab_map
from pipeline.formats import export_layouts as lay
from pipeline.formats import sglang_params as sgl_params
from pipeline.formats.file_digest import sha256
from pipeline.formats.run_dir import RunDir
from pipeline.models import targets

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]  # pipeline/engines/verify.py -> the repo root
# Both engines on CPU in one virtualenv (scripts/setup_engines.sh, requirements-engines.txt)
ENGINES_PYTHON = ROOT / lay.ENGINES["sglang"].venv / "bin" / "python"
ENGINE_MODULE = {name: e.verify_module for name, e in lay.ENGINES.items()}


def read_export(folder: Path) -> tuple[dict, dict]:
    """(export manifest, facts of the feature store it was trained on)."""
    folder = Path(folder)
    path = folder / lay.MANIFEST
    if not path.is_file():
        raise UserError(f"{folder} is not an eaglepipe export (no export_manifest.json)")
    manifest = json.loads(path.read_text())
    store = RunDir(Path(manifest["run_dir"])).features_manifest
    if not store.is_file():
        raise UserError(
            f"the export's feature store {store} is gone: the aux ids cannot be checked against it"
        )
    return manifest, json.loads(store.read_text())["facts"]


def export_architecture(manifest: dict) -> str:
    """The target class the export was made for (its aux ids' SGLang numbering depends on it): recorded in the
    manifest since 2026-12-01; for an older export, read from the target folder."""
    if manifest.get("target_architecture") is not None:
        return manifest["target_architecture"]
    folder = Path(manifest["target_path"])
    if not (folder / "config.json").is_file():
        raise UserError(
            f"the export's target {folder} is gone and its manifest does not name the target class: "
            "re-export it"
        )
    return targets.architecture(folder)


def engine_python(engine: str, python: str | None = None) -> str:
    python = python or str(ENGINES_PYTHON)
    if not Path(python).exists():
        raise UserError(
            f"verifying against {engine}'s own class needs {python}: run `make setup-engines` "
            "(or export.verify_in_engine=false to skip it, knowingly)"
        )
    return python


def configured_python(cfg, engine: str) -> str | None:
    """export.sglang_python / export.vllm_python (null = the repo's .venv-<engine>)."""
    return cfg.export[f"{engine}_python"]


def configured_memo(cfg) -> str | None:
    """The cache_dir that remembers engine reports (export.verify_memo), or None."""
    return cfg.cache_dir if cfg.export.verify_memo else None


def report_key(folder: Path, engine: str, target_dir: str, python: str, algorithm: str) -> str:
    """The sha256 of everything an engine report depends on: the export's files as the engine reads them
    (all but our manifest and serve.sh), the target's JSON files (its config; its weights are never loaded:
    the target is built on the meta device), the engines' Python and the packages installed beside it
    (name and version of each), the checking code (pipeline/**/*.py) and the algorithm asked about."""
    h = hashlib.sha256(json.dumps([engine, algorithm, str(Path(python).absolute())]).encode())
    for p in sorted(Path(folder).iterdir()):
        if p.is_file() and p.name not in (lay.MANIFEST, "serve.sh"):
            h.update(f"export/{p.name}={sha256(p)}".encode())
    for p in sorted(Path(target_dir).glob("*.json")):
        h.update(f"target/{p.name}={sha256(p)}".encode())
    venv = Path(python).absolute().parent.parent
    h.update(" ".join(sorted(d.name for d in venv.glob("lib/python*/site-packages/*.dist-info"))).encode())
    for p in sorted((ROOT / "pipeline").rglob("*.py")):
        h.update(p.read_bytes())
    return h.hexdigest()


def engine_report(
    folder: Path,
    engine: str,
    target_dir: str,
    python: str | None = None,
    algorithm: str = "EAGLE3",
    memo: str | None = None,
) -> dict:
    """Run pipeline/engines/<engine>_verify.py in the engine's virtualenv; its JSON report. For SGLang,
    `algorithm` is the --speculative-algorithm its server-side resolution is asked about. `memo`: a cache_dir
    whose engine_reports/ remember reports by report_key (the same bytes in the same engine are loaded once;
    the log says when a report is remembered, and of when)."""
    python = engine_python(engine, python)
    key = report_key(folder, engine, target_dir, python, algorithm) if memo else None
    if key and (seen := engine_memo.read(memo, key)):
        log.info(
            "%s: the engine's report of %s on the same bytes (%s; export.verify_memo=false loads it again)",
            engine,
            seen["made_at"],
            key[:12],
        )
        return seen["report"]
    cmd = [python, "-m", ENGINE_MODULE[engine], str(folder), str(target_dir)]
    if engine == "sglang":
        cmd.append(algorithm)
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}  # local folders only, no hub
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{engine} verification crashed:\n{r.stderr[-3000:]}")
    report = json.loads(r.stdout.strip().splitlines()[-1])
    if key:
        engine_memo.remember(memo, key, report)
    return report


def engine_problems(
    report: dict, want_ids: list[int] | None = None, ours: list[int] | None = None
) -> list[str]:
    """Every problem in an engine report; `want_ids` = the store's aux ids in that engine's numbering, `ours`
    =
    the store's own (the outputs of which layers the target must capture)."""
    who = f"{report['class']} ({report['engine']} {report['engine_version']})"
    problems = [f"{who} raised while loading: {e}" for e in report["errors"]]
    if report["dropped"]:
        problems.append(f"{who} silently dropped {len(report['dropped'])} tensors: {report['dropped'][:4]}")
    if report["unwritten"] or report["partly_written"]:
        problems.append(
            f"{who} parameters not written by the export: "
            f"{(report['unwritten'] + report['partly_written'])[:4]}"
        )
    if report["hot_token_id_ok"] is False:
        problems.append(f"{who}: draft->target ids (arange + d2t) are not the t2d ids")
    if report.get("captures_aux_hidden_states") is False or report.get("uses_aux_hidden_states") is False:
        problems.append(f"{who} would not feed aux hidden states to the draft (fc bypassed)")
    read = report.get("aux_layer_ids_read")
    if want_ids is not None and read != want_ids:
        problems.append(
            f"{who} reads aux layer ids {read} from the config, the store needs {want_ids}"
            + (" (None: the engine's default layers)" if read is None else "")
        )
    captured = report.get("target_layers_to_capture")  # SGLang: what the target class itself made of them
    if ours is not None and "target_layers_to_capture" in report and captured != [k + 1 for k in ours]:
        problems.append(
            f"the target's own {report.get('target_class')} captures the inputs of layers {captured}, "
            f"i.e. the outputs of layers {[k - 1 for k in captured or []]}; the draft was trained "
            f"on the outputs of {ours}"
        )
    return problems


def verify_export(
    folder: Path,
    engine: str,
    facts: dict,
    target_dir: str,
    in_engine: bool = True,
    python: str | None = None,
    architecture: str = "",
    memo: str | None = None,
) -> tuple[list[str], dict | None]:
    """(problems, engine report or None). Engine-free checks first; the engine only if they pass.
    `architecture` = the target's class (config.json `architectures[0]`); `memo`: see engine_report."""
    problems = check_export(folder, engine, facts, architecture)
    if problems or not in_engine:
        return problems, None
    report = engine_report(folder, engine, target_dir, python, memo=memo)
    ours = facts["aux_layer_ids"]
    return engine_problems(report, lay.engine_layer_ids(engine, ours, architecture), ours), report


def check_export(folder: Path, engine: str, facts: dict, architecture: str = "") -> list[str]:
    """Every problem with an export folder that needs no engine. Empty list = good."""
    folder = Path(folder)
    config, tensors, problems = _read_files(folder)
    if problems:
        return problems  # nothing else can be checked
    hidden, V = int(facts["hidden_size"]), int(facts["vocab_size"])
    want_ids = facts["aux_layer_ids"]
    ids = (
        (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if engine == "sglang"
        else config.get("eagle_aux_hidden_state_layer_ids")
    )
    try:
        engine_want = lay.engine_layer_ids(engine, want_ids, architecture)
    except lay.AuxIdsUnservable as e:
        return problems + [str(e)]
    if not ids:
        problems.append("aux layer ids missing from config.json: the engine would capture its default layers")
    elif ids != engine_want:
        problems.append(
            f"aux layer ids {ids} != {engine_want} ({engine} numbering of the store's {want_ids})"
        )
    fc = tensors.get("fc.weight")
    if fc is None:
        problems.append("fc.weight missing")
    elif fc.shape[1] != len(want_ids) * hidden:
        problems.append(
            f"fc.weight takes {fc.shape[1]} inputs, expected n_aux x hidden = {len(want_ids)} x {hidden}"
        )
    mapping = [k for k in vocab_map.MAPPING if k in tensors]
    full = isinstance(config.get("draft_vocab_size"), int) and vocab_map.full(config["draft_vocab_size"], V)
    if full and mapping and engine == "vllm":
        problems.append(
            f"{'/'.join(mapping)} in a full-vocabulary draft (draft_vocab_size {V} = the target's): vLLM "
            "builds no draft_id_to_target_id for it and cannot load a d2t; export without them"
        )
    elif full and not mapping:
        pass  # draft id = target id: neither engine wants a d2t (vocab_map.full)
    elif len(mapping) < 2:
        problems.append("d2t/t2d missing")
    else:
        try:
            vocab_map.validate(tensors["d2t"], tensors["t2d"], V, config.get("draft_vocab_size"))
        except vocab_map.VocabError as e:
            problems.append(f"vocab: {e}")
    for row in lay.tensor_table(tensors):
        if not row["finite"]:
            problems.append(f"{row['name']} has non-finite values")
        elif lay.is_dead(row):
            problems.append(
                f"{row['name']} is constant (std 0, norm {row['norm']:.3g}): not a trained weight"
            )
    if engine == "sglang":
        problems += _check_sglang(config, tensors, facts)
    else:
        bad = [
            k
            for k in tensors
            if not (k.startswith(("layers.0.", "fc.", "norm.", "lm_head.")) or k in ("d2t", "t2d"))
        ]
        if bad:
            problems.append(f"vLLM's eagle3 loader raises on unknown names: {bad[:4]}")
    return problems


def _read_files(folder: Path) -> tuple[dict, dict, list[str]]:
    """(config.json, tensors, problems): a missing or unreadable file is a problem, not a traceback."""
    config, tensors, problems = {}, {}, []
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        problems.append(f"config.json cannot be read ({type(e).__name__}: {e})")
    try:
        tensors = load_file(str(folder / "model.safetensors"))
    except (OSError, SafetensorError) as e:
        problems.append(
            f"model.safetensors cannot be read ({type(e).__name__}: {e}); export again (stage=export)"
        )
    return config, tensors, problems


SGLANG_LAYER_KEYS = {
    "llama": ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size"),
    "mla": (
        "hidden_size",
        "num_attention_heads",
        "intermediate_size",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
    ),
}


def _check_sglang(config: dict, tensors: dict, facts: dict) -> list[str]:
    problems = []
    layout = lay.draft_arch_of_export(config)
    if config.get("architectures") != [layout.sglang_class]:
        known = [[a.sglang_class] for a in lay.DRAFT_ARCHS.values()]
        problems.append(f"architectures {config.get('architectures')} is none of {known}")
    if not config.get("draft_vocab_size"):
        problems.append("draft_vocab_size missing: SGLang would use the target's lm_head, not the draft's")
    pre_rename = sorted(k for k in tensors if k.startswith("layers."))
    if pre_rename and layout.name == "llama":  # the MLA class maps layers.0.* itself, in every release
        problems.append(
            f"{len(pre_rename)} tensors named layers.* ({pre_rename[0]}, ...): SGLang before the "
            "model.layers.0 rename names the layer midlayer.* and drops layers.* without a word; "
            "the SGLang layout writes midlayer.*, which every SGLang loads"
        )
    missing = [k for k in SGLANG_LAYER_KEYS[layout.name] if not isinstance(config.get(k), int)]
    if missing:
        return problems + [f"config.json lacks {', '.join(missing)}: SGLang cannot build the draft layer"]
    report = _sglang_replay(layout, config, tensors, facts)
    if report["dropped"]:
        problems.append(f"SGLang {lay.SGLANG_VERSION} would silently drop {report['dropped'][:4]}")
    if report["unwritten"]:
        problems.append(f"SGLang parameters never written: {report['unwritten'][:4]}")
    problems += report["shape_problems"]
    hot = report["hot_token_id"]
    if (
        hot is not None
        and "t2d" in tensors
        and not bool(tensors["t2d"][hot.clamp(0, len(tensors["t2d"]) - 1)].all())
    ):
        problems.append("SGLang's hot_token_id (arange + d2t) does not point at the t2d ids")
    return problems


def _sglang_replay(layout: lay.DraftArch, config: dict, tensors: dict, facts: dict) -> dict:
    """The replay of the SGLang class's load_weights for this layout over the export's tensors."""
    c = config
    common = dict(
        hidden=c["hidden_size"],
        target_hidden=int(facts["hidden_size"]),
        n_aux=len(facts["aux_layer_ids"]),
        heads=c["num_attention_heads"],
        intermediate=c["intermediate_size"],
        vocab=int(facts["vocab_size"]),
        draft_vocab=int(c.get("draft_vocab_size") or 0),
    )
    if layout.name == "mla":
        shape = sgl_params.MLAShape(
            **common,
            q_lora=c["q_lora_rank"],
            kv_lora=c["kv_lora_rank"],
            rope=c["qk_rope_head_dim"],
            nope=c["qk_nope_head_dim"],
            v=c["v_head_dim"],
        )
        return sgl_params.sglang_mla_load_report(tensors, sgl_params.sglang_mla_param_table(shape))
    shape = sgl_params.Shape(
        **common,
        kv_heads=c["num_key_value_heads"],
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
    )
    return sgl_params.sglang_load_report(tensors, sgl_params.sglang_param_table(shape))
