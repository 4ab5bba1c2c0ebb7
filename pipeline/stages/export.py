"""Stage `export`: serving checkpoints for SGLang and vLLM from run_dir (nothing else can contradict it).

run_dir/export/<engine>/: config.json, model.safetensors (bf16 weights, d2t int64, t2d bool), serve.sh,
export_manifest.json (what produced it, aux ids in eaglepipe and engine numbering, tensor std/norm table).
Every export is verified before it is published (pipeline/engines/verify.py: engine-free checks, then the
engine's own class and loader unless export.verify_in_engine=false); `eaglepipe verify` repeats that on any
export.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from pipeline import __version__
from pipeline.capture import features
from pipeline.engines import verify
from pipeline.errors import UserError
from pipeline.fingerprint import digest, shaping
from pipeline.formats import export_layouts as lay
from pipeline.formats import feature_store as fs
from pipeline.formats import train_summary, vocab_map
from pipeline.formats.run_dir import RunDir
from pipeline.models import targets
from pipeline.serving import launch

log = logging.getLogger(__name__)
ENGINES = tuple(lay.ENGINES)


def out_dir(cfg) -> Path:
    return RunDir.of(cfg).exports


def fingerprint(cfg) -> str:
    summary = RunDir.of(cfg).train_summary
    weights = RunDir.of(cfg).final / "model.safetensors"
    serve = shaping(cfg.export.serve)
    return digest(
        {
            "summary": summary.read_text() if summary.exists() else None,
            "weights": weights.stat().st_mtime_ns if weights.exists() else None,
            "engines": list(cfg.export.engines),
            "serve": serve,
        }
    )


def is_complete(cfg) -> bool:
    """Every engine's export published and as it was then (lay.damage); a damaged one is exported again."""
    for engine in cfg.export.engines:
        if not RunDir.of(cfg).export_manifest(engine).is_file():
            return False
        if problem := lay.damage(RunDir.of(cfg).export(engine)):
            log.warning("export/%s is damaged (%s): exporting it again", engine, problem)
            return False
    return True


def check(cfg) -> None:
    """Every problem with the export settings, before an existing export is touched."""
    problems = [
        f"export.engines: {e!r} is not one of {list(ENGINES)}" for e in cfg.export.engines if e not in ENGINES
    ]
    if not cfg.export.engines:
        problems.append("export.engines is empty")
    layout = lay.DRAFT_ARCHS.get(str(getattr(cfg.train.draft_arch, "value", cfg.train.draft_arch)))
    unverified = [e for e in cfg.export.engines if layout and e in ENGINES and e not in layout.engines]
    if unverified:
        problems.append(
            f"export.engines={list(cfg.export.engines)} with train.draft_arch={layout.name}: that layout "
            f"is verified against {', '.join(layout.engines)} only; set "
            f"export.engines=[{','.join(layout.engines)}]"
        )
    if problems:
        raise UserError("; ".join(problems))


def _selected_dir(final: Path, selected: dict) -> Path:
    """final/ (the last step), or train/best_tau/ when train chose by tau (train.select=tau); checked against
    the
    step train recorded, so a folder of another run is never exported."""
    if selected.get("by") != "tau":
        return final
    best = final.parent / selected["path"]
    try:
        there = json.loads((best / "selected.json").read_text())
    except (OSError, json.JSONDecodeError):
        there = None
    if not there or there.get("step") != selected["step"]:
        raise UserError(
            f"train chose step {selected['step']} by tau, but {best} holds "
            f"{'nothing readable' if not there else 'step ' + str(there.get('step'))}; rerun stage=train"
        )
    log.info(
        "export: train.select=tau: step %d (tau %.4f at k=%d) from %s",
        selected["step"],
        selected["tau"],
        selected["k"],
        best,
    )
    return best


def _load_final(final: Path) -> tuple[dict, dict]:
    """train/final's weights and config; a damaged or missing file is one line with the fix."""
    fix = (
        f"delete {final} and rerun stage=train: it resumes from the newest checkpoint under "
        f"{final.parent} and writes final/ again"
    )
    try:
        return load_file(str(final / "model.safetensors")), json.loads((final / "config.json").read_text())
    except (OSError, SafetensorError, json.JSONDecodeError) as e:
        raise UserError(
            f"the trained draft in {final} cannot be read ({type(e).__name__}: {e}); {fix}"
        ) from None


def run(cfg) -> Path:
    check(cfg)
    final = RunDir.of(cfg).final
    if not train_summary.exists(final):
        raise UserError(f"no trained draft under {final}; run stage=train first")
    store = features.open_source(cfg)  # the facts only: aux ids, target, hash
    d2t, t2d, vman = vocab_map.load(RunDir.of(cfg).vocab)
    selected = train_summary.read(final).get("selected") or {"by": "last"}
    weights, draft_cfg = _load_final(_selected_dir(final, selected))
    if draft_cfg["eagle_aux_hidden_state_layer_ids"] != store.aux_layer_ids:
        raise UserError(
            f"trained draft has aux ids {draft_cfg['eagle_aux_hidden_state_layer_ids']}, the feature "
            f"store {store.aux_layer_ids}; retrain"
        )
    if not vocab_map.matches(weights, d2t, t2d):  # a full vocabulary: no d2t/t2d in weights nor export
        raise UserError(f"the trained draft's d2t/t2d differ from {cfg.run_dir}/vocab; retrain")
    tensors = {
        k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in lay.draft_owned(weights).items()
    }
    provenance = {
        "produced_by": f"eaglepipe {__version__}",
        "run_dir": str(Path(cfg.run_dir).resolve()),
        "target_path": store.facts["target_path"],
        "target_fingerprint": store.facts["target_fingerprint"],
        "features_manifest_hash": store.manifest_hash(),
        "vocab_coverage": vman["coverage"],
        "train_summary_hash": digest(train_summary.path(final).read_text()),
        "aux_layer_ids_eaglepipe": store.aux_layer_ids,
        "selected": selected,
        "target_architecture": targets.architecture(Path(store.facts["target_path"])),
    }
    layout = lay.draft_arch_of(draft_cfg["transformer_layer_config"]["model_type"])
    provenance["draft_arch"] = layout.name
    unverified = [e for e in cfg.export.engines if e not in layout.engines]
    if unverified:
        raise UserError(
            f"export.engines: the {layout.name} draft's layout is verified against "
            f"{', '.join(layout.engines)} only, not {', '.join(unverified)}: "
            f"export.engines=[{','.join(layout.engines)}]"
        )
    for engine in cfg.export.engines:
        _publish(cfg, engine, tensors, provenance, draft_cfg, store, layout)
    return out_dir(cfg)


def _publish(cfg, engine: str, tensors: dict, provenance: dict, draft_cfg: dict, store, layout) -> None:
    """export/<engine>/: the engine's layout of the draft, its config, serve.sh and manifest, written into
    a .tmp folder, checked (verify, the engine's own class where export.verify_in_engine), then renamed
    into place; a failed check leaves the previous export as it was."""
    arch, layer = provenance["target_architecture"], draft_cfg["transformer_layer_config"]
    out = out_dir(cfg) / engine
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        engine_ids = lay.engine_layer_ids(engine, store.aux_layer_ids, arch)
    except lay.AuxIdsUnservable as e:
        raise UserError(f"export/{engine}: {e} (extract.aux_layers, then extract and train again)") from None
    if engine == "sglang":
        names = lay.sglang_tensors(tensors)
        config = sglang_config(layer, draft_cfg, store, engine_ids, layout)
    else:
        names = dict(tensors)
        config = vllm_config(draft_cfg, store, engine_ids)
    save_file(names, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    rows = lay.tensor_table(names)
    manifest = {
        "schema_version": lay.SCHEMA_VERSION,
        "engine": engine,
        "engine_version_read": lay.engine_version(engine),
        "aux_layer_ids_engine": engine_ids,
        **provenance,
        "draft_kv_bytes_per_token": lay.draft_kv_bytes_per_token(
            config if engine == "sglang" else sglang_config(layer, draft_cfg, store, engine_ids, layout)
        ),
        "tensors": rows,
    }
    launch.write_serve(
        tmp, engine, store.facts["target_path"], out, cfg.export.serve, {"by": "config"}, manifest
    )
    lay.record_files(tmp, manifest)  # the sha256 is_complete and evaluate check before they trust it
    (tmp / lay.MANIFEST).write_text(json.dumps(manifest, indent=1))
    python, memo = verify.configured_python(cfg, engine), verify.configured_memo(cfg)
    problems, report = verify.verify_export(
        tmp, engine, store.facts, store.facts["target_path"], cfg.export.verify_in_engine, python, arch, memo
    )
    if report:
        manifest["verified_by"] = {k: report[k] for k in ("engine", "engine_version", "class")}
        (tmp / lay.MANIFEST).write_text(json.dumps(manifest, indent=1))
    if problems:
        raise UserError(f"export/{engine} failed its checks: " + "; ".join(problems))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    log.info(
        "export %s -> %s (aux ids %s in %s numbering); tensors:\n%s",
        engine,
        out,
        engine_ids,
        engine,
        lay.format_table(rows),
    )


def sglang_config(
    layer: dict, draft_cfg: dict, store, aux_ids: list[int], layout: lay.DraftArch = lay.DRAFT_ARCHS["llama"]
) -> dict:
    return lay.sglang_config(
        layer, draft_cfg, int(store.facts["vocab_size"]), store.hidden_size, aux_ids, layout
    )


def vllm_config(draft_cfg: dict, store: fs.FeatureStore, aux_ids: list[int]) -> dict:
    config = json.loads(json.dumps(draft_cfg))
    config["eagle_aux_hidden_state_layer_ids"] = aux_ids
    config["speculators_config"]["verifier"]["name_or_path"] = store.facts["target_path"]
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        config[flag] = bool(config.get(flag, False))  # explicit: vLLM's defaults differ by route
    config["dtype"] = "bfloat16"
    return config
