"""Import shims that let SGLang's model classes be BUILT and LOADED on a CPU-only machine. Nothing else.

Why: sglang 0.5.23 imports (a) torchvision somewhere on its import path, and PyPI's torchvision is
CUDA-linked and fails to import beside a CPU torch; (b) `vllm._custom_ops` from its rotary-embedding module
off-CUDA. Neither is CALLED to construct `LlamaForCausalLMEagle3` or to run its `load_weights`: the stand-ins
below only satisfy `import`. Any attribute actually used raises, so a shim can never make a check pass.
"""

import importlib.machinery
import sys
import types


class _Unusable(types.ModuleType):
    """`from shim import X` gives a placeholder class; creating or calling one raises."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        where = f"{self.__name__}.{name}"

        def refuse(*args, **kwargs):
            raise RuntimeError(f"{where} is an import shim (pipeline/engines/shims.py) and was used")

        placeholder = type(name, (), {"__init__": refuse, "__call__": refuse})
        setattr(self, name, placeholder)
        return placeholder


def _module(name: str) -> types.ModuleType:
    m = _Unusable(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None)
    m.__path__ = []  # a package, so submodule imports resolve to more shims
    return m


def install(torchvision: bool = True) -> None:
    # transformers decides once whether torchvision is available; let it see the truth (no) first, so that
    # only sglang's own `import torchvision.transforms` meets the stand-in.
    import transformers.image_utils  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    names = ["vllm", "vllm._custom_ops"] + (
        ["torchvision", "torchvision.transforms", "torchvision.io", "torchvision.transforms.functional"]
        if torchvision
        else []
    )
    for name in names:
        if name not in sys.modules:
            sys.modules[name] = _module(name)
