"""speculators imported without compiling at import time (pipeline/lazy_compile.py)."""

import subprocess
import sys

import torch

from pipeline import lazy_compile

IMPORTS = """
import sys, torch
from pipeline import lazy_compile
real = torch.compile
if {deferred}:
    with lazy_compile.compile_deferred():
        import speculators.models.eagle3
else:
    import speculators.models.eagle3
assert torch.compile is real
print("inductor" if "torch._inductor.compile_fx" in sys.modules else "no inductor")
"""


def _imports(deferred: bool) -> str:
    code = IMPORTS.format(deferred=deferred)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip()


def test_speculators_imported_inside_deferred_does_not_import_inductor():
    """The ~2 s import is what speculators' dflash pays at import (the control proves the check can fail)."""
    assert _imports(deferred=False) == "inductor"
    assert _imports(deferred=True) == "no inductor"


def test_a_deferred_compile_compiles_on_the_first_call_with_the_same_arguments_once():
    calls = []

    def real(fn, *args, **kwargs):
        calls.append((fn, args, kwargs))
        return lambda *a: ("compiled", fn(*a))

    def double(x):
        return 2 * x

    later = lazy_compile._later(real)
    f = later(double, dynamic=False)
    g = later(dynamic=True)(double)  # the decorator form, @torch.compile(dynamic=True)
    assert calls == [] and f.__name__ == "double"
    assert f(3) == ("compiled", 6) and f(4) == ("compiled", 8)
    assert g(1) == ("compiled", 2)
    assert calls == [(double, (), {"dynamic": False}), (double, (), {"dynamic": True})]


def test_torch_compile_is_itself_again_after_deferred_even_on_an_error():
    real = torch.compile
    try:
        with lazy_compile.compile_deferred():
            assert torch.compile is not real
            raise ValueError
    except ValueError:
        pass
    assert torch.compile is real
