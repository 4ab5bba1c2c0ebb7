"""The house: imports run down only, floor by floor, and no room is too large.

Floors, top to bottom (docs/stages.md draws them):
  the CLI and the runner (`__main__`, `cli` (help, completion), `cli_help` (the pages), `runner`)
  tools/ and stages/: side by side; a stage never imports a tool, a tool never a stage, a stage no other stage
  the packages that do the work, themselves in order: training > acceptance > capture > data > serving >
  engines > models (each imports only those after it)
  formats/: every on-disk artifact's reader and writer; nothing of the project but config, errors and
  lazy_compile (how speculators is imported)
  the ground: config_limits (over config), config_choices, errors, lazy_compile, fingerprint, corpora, ranks,
  the package's own `__version__`; under them all `commands` (the stages' and tools' names)
So any stage can be read, run and replaced on its own, and a change to a format is felt only above it.
"""

import ast
from pathlib import Path

import pytest

from pipeline.runner import ORDER

PKG = Path(__file__).resolve().parents[2] / "pipeline"
PACKAGES = ["training", "acceptance", "capture", "data", "serving", "engines", "models", "cluster"]
MAX_MODULE_LINES = 400
MAX_STAGE_LINES = 250
MAX_FUNCTION_LINES = 80  # issue #11: "no function in pipeline/ is longer than 80 lines"


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


def room(module: str) -> str:
    """The room a module lives in: its package under pipeline/ (`stages`, `formats`, ...), or the module
    itself
    at the top (`runner`, `config`, ...); `pipeline` for the package's own __init__."""
    parts = module.split(".")
    if parts[0] != "pipeline":
        return ""
    if len(parts) == 1 or not ((PKG / parts[1]).is_dir() or (PKG / f"{parts[1]}.py").is_file()):
        return (
            "pipeline"  # the package itself, or a name of its __init__ (`from pipeline import __version__`)
        )
    return parts[1]


FLOORS = [
    ["__main__"],
    ["cli"],
    ["cli_help"],
    ["runner"],
    ["tools", "stages"],
    *[[p] for p in PACKAGES],
    ["formats"],
    ["config_limits"],
    ["config", "corpora", "fingerprint", "ranks", "intervals"],
    ["config_choices", "config_tools", "errors", "lazy_compile", "pipeline"],
    ["commands"],
]


FORMATS_MAY_IMPORT = ("formats", "config", "config_choices", "errors", "lazy_compile")


def floor(r: str) -> int:
    return next(i for i, rooms in enumerate(FLOORS) if r in rooms)


def violations(path: Path, module: str) -> list[str]:
    """`module -> imported: why` for every import of `path` (the file of `module`) that runs up or
    sideways."""
    own, out = room(module), []
    for target in sorted(m for m in imported_modules(path) if room(m)):
        other = room(target)
        if own == "stages" and other == "stages" and target.split(".")[:3] != module.split(".")[:3]:
            if len(target.split(".")) > 2 and target.split(".")[2] in ORDER:
                out.append(f"{module} -> {target}: a stage never imports another stage")
        elif {own, other} == {"stages", "tools"}:
            out.append(f"{module} -> {target}: tools and stages never import each other")
        elif own == "formats" and other not in FORMATS_MAY_IMPORT:
            out.append(f"{module} -> {target}: formats/ imports nothing of the project but config and errors")
        elif own != other and floor(other) < floor(own):
            out.append(f"{module} -> {target}: runs up ({own} is below {other})")
        elif own != other and floor(other) == floor(own):
            out.append(f"{module} -> {target}: sideways between {own} and {other}")
    return out


def modules() -> list[tuple[Path, str]]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append((path, ".".join(parts)))
    return out


def test_imports_run_down_only():
    found = [v for path, module in modules() for v in violations(path, module)]
    assert found == [], "\n".join(found)


def planted(tmp_path, text: str) -> Path:
    f = tmp_path / "fake.py"
    f.write_text(text)
    return f


@pytest.mark.parametrize(
    "module,text,says",
    [
        ("pipeline.stages.export", "from pipeline.tools import verify\n", "tools and stages never import"),
        ("pipeline.tools.parity", "def f():\n    from pipeline.stages import extract\n", "tools and stages"),
        ("pipeline.stages.vocab", "from pipeline.stages.extract import out_dir\n", "another stage"),
        (
            "pipeline.models.targets",
            "from pipeline.data.sources import load\n",
            "runs up (models is below data)",
        ),
        ("pipeline.formats.vocab_map", "import pipeline.models.draft\n", "formats/ imports nothing"),
        ("pipeline.capture.store", "from pipeline.runner import run_stages\n", "runs up"),
        ("pipeline.config", "from pipeline.formats import checkpoint\n", "runs up (config is below formats)"),
    ],
)
def test_a_planted_import_that_runs_up_or_sideways_is_caught(tmp_path, module, text, says):
    found = violations(planted(tmp_path, text), module)
    assert found and all(says in f for f in found), found


def test_imports_that_run_down_pass(tmp_path):
    text = (
        "from pipeline.capture import store\nfrom pipeline.formats import vocab_map\nfrom pipeline "
        "import errors"
    )
    assert violations(planted(tmp_path, text), "pipeline.stages.extract") == []
    assert (
        violations(planted(tmp_path, "from pipeline.models import targets\n"), "pipeline.data.regenerate")
        == []
    )


def test_every_room_of_pipeline_has_a_floor():
    rooms = {room(module) for _, module in modules()}
    placed = {r for rooms in FLOORS for r in rooms}
    assert rooms - placed == set(), "give these a floor in test_architecture (and docs/stages.md)"


def test_no_module_is_over_400_lines_and_no_stage_over_250():
    big = [
        f"{path.relative_to(PKG.parent)} ({n} lines)"
        for path, _ in modules()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
        or path.parent.name == "stages"
        and n > MAX_STAGE_LINES
    ]
    assert big == [], "split these: " + "; ".join(big)


@pytest.mark.parametrize("stage", ORDER)
def test_a_stage_imports_no_other_stage_and_not_the_runner(stage):
    path = PKG / "stages" / f"{stage}.py"
    assert violations(path, f"pipeline.stages.{stage}") == []
    assert not any(m.startswith("pipeline.runner") for m in imported_modules(path))


def test_the_check_sees_imports_at_any_depth(tmp_path):
    f = planted(tmp_path, "import os\ndef g():\n    from pipeline.stages.extract import Capture\n")
    assert violations(f, "pipeline.stages.evaluate") == [
        "pipeline.stages.evaluate -> pipeline.stages.extract: a stage never imports another stage",
        "pipeline.stages.evaluate -> pipeline.stages.extract.Capture: a stage never imports another stage",
    ]


def test_the_folders_are_the_map_in_docs_stages_md():
    """Each folder of pipeline/ holds what docs/stages.md says it holds: the stages exactly ORDER."""
    assert sorted(p.stem for p in (PKG / "stages").glob("*.py") if p.stem != "__init__") == sorted(ORDER)
    doc = (PKG.parent / "docs" / "stages.md").read_text()
    for folder in sorted(p.name for p in PKG.iterdir() if p.is_dir() and not p.name.startswith("__")):
        assert f"`pipeline/{folder}/`" in doc, f"docs/stages.md has no paragraph for pipeline/{folder}/"


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
