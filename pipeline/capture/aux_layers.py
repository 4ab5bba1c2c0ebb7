"""The aux-layer numbering, one home: aux id k = the output of 0-based decoder layer k (the residual stream
after it, = HF hidden_states[k+1]); the default ids; the validation of requested ids. docs/conventions.md.
"""

from __future__ import annotations

from pipeline.errors import UserError

CONVENTION = (
    "eaglepipe: id k = output (residual stream after) 0-based decoder layer k = HF hidden_states[k+1]"
)


def default_aux_layers(num_layers: int) -> list[int]:
    """[1, L//2-1, L-4]: the same physical layers as SGLang's and vLLM's defaults (docs/conventions.md)."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def aux_layer_ids(requested: list | None, num_layers: int) -> list[int]:
    """Validated aux ids (one error listing every problem)."""
    ids = default_aux_layers(num_layers) if requested is None else [int(i) for i in requested]
    problems = []
    if not ids:
        problems.append("extract.aux_layers is empty")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        problems.append(
            f"aux layer ids {bad} outside [0, {num_layers - 1}] (the target has {num_layers} layers)"
        )
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        problems.append(f"aux layer ids {dup} repeated")
    if problems:
        raise UserError("extract.aux_layers=" + str(list(requested or ids)) + ": " + "; ".join(problems))
    return ids
