"""Importing speculators without what it compiles at import time.

speculators' package imports every draft family it has; dflash's module calls
`torch.compile(create_block_mask)` while being imported, and on CUDA each family's methods are decorated with
torch.compile. torch.compile's first call imports inductor: ~2 s of every process that imports speculators
(each SLURM train rank, the vocab job, evaluate) on a 2-core node, for a function EAGLE-3 never calls. Inside
`compile_deferred()`, torch.compile returns a
function that compiles on its first call, which is when torch.compile compiles anyway (same arguments, same
compiled function after that); outside it, torch.compile is itself again."""

from __future__ import annotations

import contextlib
import functools
import threading

_lock = threading.Lock()


def _later(real):
    def compile_later(fn=None, *args, **kwargs):
        if fn is None:  # @torch.compile(dynamic=False)
            return functools.partial(compile_later, *args, **kwargs)
        compiled = []

        @functools.wraps(fn)
        def first_call_compiles(*a, **kw):
            if not compiled:
                compiled.append(real(fn, *args, **kwargs))
            return compiled[0](*a, **kw)

        return first_call_compiles

    return compile_later


@contextlib.contextmanager
def compile_deferred():
    """`with compile_deferred(): from speculators... import ...`: the torch.compile calls the import makes
    wait for their function's first call."""
    import torch

    with _lock:
        real = torch.compile
        torch.compile = _later(real)
        try:
            yield
        finally:
            torch.compile = real
