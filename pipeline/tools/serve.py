"""`eaglepipe serve [engine=sglang|vllm] [run_dir=...]`: print the launch command of each export.

The command itself is written at export time (pipeline/serving/launch.py -> export/<engine>/serve.sh), from
the export's own target path and export.serve (`eaglepipe tune-serve` rewrites it with measured settings);
this prints it, so what is printed is what was verified.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import UserError
from pipeline.formats.run_dir import RunDir


def run(cfg) -> Path:
    engines = [cfg.engine] if cfg.engine else list(cfg.export.engines)
    root = Path(cfg.export_dir).parent if cfg.export_dir else RunDir.of(cfg).exports
    for engine in engines:
        script = root / engine / "serve.sh"
        if not script.is_file():
            raise UserError(f"no {script}: run stage=export first (export.engines includes {engine}?)")
        print(f"# {engine}: {root / engine}\n{script.read_text().strip()}")
    return root
