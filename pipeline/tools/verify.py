"""`eaglepipe verify export_dir=<run_dir>/export/<engine> [engine=sglang|vllm]`: will the engine load it all?

The checks are pipeline/engines/verify.py: the export's own invariants (no engine needed), then the engine's
own model class and loader on CPU (.venv-engines). This tool prints what they found, per export.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.engines.verify import (
    ENGINE_MODULE,
    configured_memo,
    configured_python,
    export_architecture,
    read_export,
    verify_export,
)
from pipeline.errors import UserError
from pipeline.formats.run_dir import RunDir


def run(cfg) -> Path:
    """Verify one export (export_dir=...), or every engine's export of run_dir."""
    folders = (
        [Path(cfg.export_dir)] if cfg.export_dir else [RunDir.of(cfg).export(e) for e in cfg.export.engines]
    )
    failed = 0
    for folder in folders:
        manifest, facts = read_export(folder)
        engine = cfg.engine or manifest["engine"]
        if engine not in ENGINE_MODULE:
            raise UserError(f"engine={engine!r}: known engines are {', '.join(ENGINE_MODULE)}")
        if engine != manifest["engine"]:
            print(f"verify: {folder} is in {manifest['engine']}'s layout; checking it as {engine} anyway")
        problems, report = verify_export(
            folder,
            engine,
            facts,
            manifest["target_path"],
            True,
            configured_python(cfg, engine),
            export_architecture(manifest),
            configured_memo(cfg),
        )
        for p in problems:
            print(f"verify: {engine}: {p}")
        if problems:
            failed += 1
            continue
        print(
            f"verify: {folder} loads completely into {report['engine']} {report['engine_version']}'s own "
            f"{report['class']}: {len(report['consumed'])} tensors consumed, 0 dropped, "
            f"every engine parameter written but the embedding (the target's), aux layer ids "
            f"{report['aux_layer_ids_read']} read by the engine"
            + (
                f" (the target's own {report['target_class']} captures the outputs of layers "
                f"{[k - 1 for k in report['target_layers_to_capture']]})"
                if report.get("target_class")
                else ""
            )
            + (
                ", draft->target ids = arange + d2t"
                if any(row["name"] == "d2t" for row in manifest["tensors"])
                else ", a full-vocabulary draft: draft id = target id, no d2t"
            )
        )
    if failed:
        raise UserError(f"{failed} of {len(folders)} export(s) failed verification")
    return folders[0].parent
