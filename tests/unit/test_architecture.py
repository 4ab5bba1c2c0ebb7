"""The package's floors follow the data flow: a stage never imports another stage, nor the runner that loads it.

Stages meet only through what they write on disk (pipeline/formats/) and shared pieces that live below them
(pipeline/engines/, pipeline/fingerprint.py, ...), so any stage can be read, run and replaced on its own.
"""

import ast
from pathlib import Path

import pytest

from pipeline.stages import ORDER

PKG = Path(__file__).resolve().parents[2] / "pipeline"


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}  # `from pipeline import prepare`
    return found


def stage_imports(path: Path, own: str) -> list[str]:
    forbidden = {f"pipeline.{s}" for s in ORDER if s != own} | {"pipeline.stages"}
    return sorted(m for m in imported_modules(path) if m in forbidden or any(m.startswith(f + ".") for f in forbidden))


@pytest.mark.parametrize("stage", ORDER)
def test_a_stage_imports_no_other_stage_and_not_the_runner(stage):
    assert stage_imports(PKG / f"{stage}.py", stage) == []


def test_the_check_sees_imports_at_any_depth(tmp_path):
    f = tmp_path / "fake.py"
    f.write_text("from pipeline import prepare\nimport pipeline.stages\ndef g():\n    from pipeline.extract import Capture\n")
    assert stage_imports(f, "evaluate") == ["pipeline.extract", "pipeline.extract.Capture", "pipeline.prepare",
                                            "pipeline.stages"]
