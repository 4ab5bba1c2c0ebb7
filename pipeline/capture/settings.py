"""extract's settings checked before anything is captured: SGLang present at a version eaglepipe supports
(extract.backend=sglang), a CUDA device that exists, writer processes only with the zarr writer. The extract
stage and `eaglepipe parity` call it."""

from __future__ import annotations

from pipeline import config_limits
from pipeline.errors import UserError


def backend(cfg) -> str:
    return str(getattr(cfg.extract.backend, "value", cfg.extract.backend))


def check(cfg) -> None:
    """Every extract setting, before anything is captured (the extract stage and `eaglepipe parity` call
    it)."""
    check_backend(cfg)  # ranges and closed sets: config_limits, checked before every stage's check
    if problem := config_limits.cuda_missing("extract.device", cfg.extract.device):
        raise UserError(problem)
    writer = str(getattr(cfg.extract.writer, "value", cfg.extract.writer))
    if cfg.extract.write_workers > 1 and writer != "zarr":
        raise UserError(
            f"extract.write_workers={cfg.extract.write_workers} starts zarr-python writer processes; "
            f"extract.writer={writer} already writes on every core: set extract.writer=zarr to use them, "
            "or leave write_workers at 1"
        )


def check_backend(cfg) -> None:
    """extract.backend=sglang: SGLang importable here, at a version eaglepipe supports (one line if not)."""
    if backend(cfg) == "sglang":
        from pipeline.engines import sglang_capture as sc

        try:
            import sglang
        except ImportError:
            raise UserError(
                f"extract.backend=sglang needs sglang {sc.SUPPORTED[0]} .. {sc.SUPPORTED[1]} (and a "
                "CUDA GPU) in this Python; README, 'SGLang capture backend', has the GPU-box commands"
            ) from None
        if problem := sc.version_problem(sglang.__version__):
            raise UserError(problem)
