"""Watch an engine's OWN `load_weights` fill its OWN model: what it consumed, dropped, and never wrote.

Imported inside the engine virtualenvs (.venv-engines), so it needs only torch. The method:
every engine parameter is poisoned with NaN before loading, and every weight loader the engine can call is
wrapped to record which exported tensor it received. After `load_weights`: a tensor no loader received was
dropped (silently, if the engine raised nothing), a parameter still all-NaN was never written, a parameter
partly NaN was written only in part (e.g. q but not k/v of a fused qkv). A loader that concatenates tensors
before writing them (SGLang's MLA draft: q_a_proj + kv_a_proj_with_mqa -> fused_qkv_a_proj_with_mqa) hands its
weight loader a new tensor: an exported tensor no loader received is still consumed when its values sit,
whole, as a block of rows of a parameter (found by content for matrices, reported as `consumed_fused`; a
vector is never matched this way: its rows are scalars).
"""

from __future__ import annotations

import torch


class LoaderAudit:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.params = dict(model.named_parameters())
        self.consumed: set[int] = set()
        with torch.no_grad():
            for p in self.params.values():
                if p.is_floating_point():
                    p.fill_(float("nan"))

    def recording(self, loader):
        def wrapped(param, loaded_weight, *args, **kwargs):
            self.consumed.add(id(loaded_weight))
            return loader(param, loaded_weight, *args, **kwargs)

        return wrapped

    def wrap_param_loaders(self, default_loader) -> None:
        """Each parameter's own `weight_loader`, or the engine's default where it has none."""
        for p in self.params.values():
            p.weight_loader = self.recording(getattr(p, "weight_loader", default_loader))

    def load(self, path: str, default_loader) -> tuple[dict[str, torch.Tensor], list[str]]:
        """Every tensor of the export's safetensors file through the engine's own `model.load_weights`, each
        parameter's loader recorded. What the engine raises (a shape mismatch, a name it cannot place)
        becomes an
        error line of the report, not a traceback: the audit still says what was and was not written."""
        from safetensors.torch import load_file

        self.wrap_param_loaders(default_loader)
        tensors = load_file(path)
        errors = []
        try:
            self.model.load_weights(list(tensors.items()))
        except Exception as e:  # the engine's loader refused the export
            errors.append(f"{type(e).__name__}: {e}")
        return tensors, errors

    def report(
        self,
        tensors: dict[str, torch.Tensor],
        not_loaded_by_design: set[str],
        from_target: set[str],
        errors: list[str],
    ) -> dict:
        seen = {k for k, v in tensors.items() if id(v) in self.consumed}
        fused = {
            k
            for k, v in tensors.items()
            if k not in seen
            and k not in not_loaded_by_design
            and v.is_floating_point()
            and v.dim() >= 2
            and self._rows_of_a_param(v)
        }
        seen |= fused
        floating = {n: p for n, p in self.params.items() if p.is_floating_point() and n not in from_target}
        unwritten = sorted(n for n, p in floating.items() if bool(torch.isnan(p).all()))
        partly = sorted(n for n, p in floating.items() if bool(torch.isnan(p).any()) and n not in unwritten)
        return {
            "consumed": sorted(seen),
            "consumed_fused": sorted(fused),
            "dropped": sorted(set(tensors) - seen - not_loaded_by_design),
            "unwritten": unwritten,
            "partly_written": partly,
            "errors": errors,
            "parameters": {n: list(p.shape) for n, p in self.params.items()},
        }

    def _rows_of_a_param(self, t: torch.Tensor) -> bool:
        """Whether t's values are rows [i, i + len(t)) of some parameter (candidate offsets: rows equal to
        t[0])."""
        for p in self.params.values():
            if (
                p.dim() != t.dim()
                or p.shape[1:] != t.shape[1:]
                or p.shape[0] < t.shape[0]
                or not p.is_floating_point()
            ):
                continue
            w, row = p.detach(), t[0].to(p.dtype)
            for i in torch.nonzero((w[: len(w) - len(t) + 1] == row).flatten(1).all(1)).flatten().tolist():
                if torch.equal(w[i : i + len(t)], t.to(p.dtype)):
                    return True
        return False


def single_process_world(parallel_state) -> None:
    """A gloo world of 1 and model parallel groups of 1, through the engine's own `parallel_state` module
    (sglang.srt.distributed and vllm.distributed expose the same two calls). Idempotent."""
    import socket

    if parallel_state.model_parallel_is_initialized():
        return
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    parallel_state.init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method=f"tcp://127.0.0.1:{port}"
    )
    parallel_state.initialize_model_parallel()
