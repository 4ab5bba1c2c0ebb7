"""The suite collects every test file: tests/ has no __init__.py, so pytest imports each file by its basename
and a second file of the same name is not collected at all (one ERROR line among a thousand dots; #48 found
tests/unit/test_cli.py lost that way beside tests/integration/test_cli.py)."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_file_has_a_basename_of_its_own():
    names = Counter(p.name for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)
    assert not [n for n, c in names.items() if c > 1], sorted(n for n, c in names.items() if c > 1)
