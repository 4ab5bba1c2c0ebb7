"""The package's floors follow the data flow: a stage never imports another stage, nor the runner that loads
it.

Stages meet only through what they write on disk (pipeline/formats/) and shared pieces that live below them
(pipeline/engines/, pipeline/fingerprint.py, ...), so any stage can be read, run and replaced on its own.
"""

import ast
from pathlib import Path

import pytest

from pipeline.runner import ORDER

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
    forbidden = {f"pipeline.stages.{s}" for s in ORDER if s != own} | {"pipeline.runner"}
    return sorted(
        m for m in imported_modules(path) if m in forbidden or any(m.startswith(f + ".") for f in forbidden)
    )


@pytest.mark.parametrize("stage", ORDER)
def test_a_stage_imports_no_other_stage_and_not_the_runner(stage):
    assert stage_imports(PKG / "stages" / f"{stage}.py", stage) == []


def test_the_check_sees_imports_at_any_depth(tmp_path):
    f = tmp_path / "fake.py"
    f.write_text(
        "from pipeline.stages import prepare\nimport pipeline.runner\ndef g():\n"
        "    from pipeline.stages.extract import Capture\n"
    )
    assert stage_imports(f, "evaluate") == [
        "pipeline.runner",
        "pipeline.stages.extract",
        "pipeline.stages.extract.Capture",
        "pipeline.stages.prepare",
    ]


def test_the_folders_are_the_map_in_docs_stages_md():
    """Each folder of pipeline/ holds what docs/stages.md says it holds: the stages exactly ORDER."""
    assert sorted(p.stem for p in (PKG / "stages").glob("*.py") if p.stem != "__init__") == sorted(ORDER)
    doc = (PKG.parent / "docs" / "stages.md").read_text()
    for folder in sorted(p.name for p in PKG.iterdir() if p.is_dir() and not p.name.startswith("__")):
        assert f"`pipeline/{folder}/`" in doc, f"docs/stages.md has no paragraph for pipeline/{folder}/"


MAX_FUNCTION_LINES = 80  # issue #11: "no function in pipeline/ is longer than 80 lines"


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """`file:line name (N lines)` for every function or method (nested ones too) whose def-to-last-line span
    is over `limit` lines."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_in_pipeline_is_longer_than_80_lines():
    offenders = [f for path in sorted(PKG.rglob("*.py")) for f in long_functions(path)]
    assert offenders == [], "split these: " + "; ".join(offenders)


def test_the_length_check_counts_def_to_last_line_of_functions_and_methods_at_any_depth(tmp_path):
    def body(n, indent):
        return "".join(f"{indent}x{i} = {i}\n" for i in range(n))

    f = tmp_path / "fake.py"
    f.write_text(
        "def fits():\n"
        + body(79, "    ")  # lines 1-80: 80 lines, allowed
        + "def over():\n"
        + body(80, "    ")  # lines 81-161: 81 lines
        + "class C:\n    def method(self):\n        def inner():\n"
        + body(80, " " * 12)
        + "        return inner\n"
    )  # method: lines 163-245 (83), inner: 164-244 (81)
    assert long_functions(f) == [
        "fake.py:81 over (81 lines)",
        "fake.py:163 method (83 lines)",
        "fake.py:164 inner (81 lines)",
    ]
