"""FSDP2 for the draft (`train.strategy=fsdp`): full-shard every parameter over the ranks, checkpoint the
shards with torch.distributed.checkpoint, gather the full weights once for train/final/.

accelerate 1.15 cannot do this on CPU (its FSDP switch exists only for GPU distributed types; with `--cpu` the
plugin is silently dropped and the model is wrapped in DDP), and its `save_state` cannot write DTensor
parameters. So train keeps accelerate for the device, gradient accumulation, backward, clipping and the
optimizer wrapper, and wraps and checkpoints the model here, with torch's own fully_shard + DCP, the same on
CPU (gloo) and GPU (nccl).

- Units: each decoder layer, the fc, the (frozen) target embedding and the two (frozen) heads are their own
  FSDP unit, then the root: at most one unit's parameters are gathered at a time. Frozen parameters are
  sharded too (no gradient, not in the optimizer: the optimizer is built over requires_grad ones only).
- Checkpoints hold the trainable parameters and the optimizer state, sharded (`dcp/`), and resume on any
number
  of ranks (DCP reshards on load). The frozen ones are rebuilt from the target at every start, as on DDP.
"""

from __future__ import annotations

from pathlib import Path

import torch

DCP_DIR = "dcp"


def shard(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Shard in place. Parameters stay fp32 and are gathered in fp32: the forward runs under accelerate's
    autocast,
    as DDP's does, so both strategies compute the same thing (bf16 gathers would halve the traffic, not the
    math)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model.to(device)
    for unit in [*model.layers, model.fc, model.embed_tokens, model.lm_head, model.verifier_lm_head]:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _options(full: bool = False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if full:
        return StateDictOptions(full_state_dict=True, cpu_offload=True)
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def save(folder: Path, model, optimizer) -> None:
    """Every rank writes its shards of the trainable parameters and the optimizer state (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, _inner(optimizer), options=_options())
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(Path(folder) / DCP_DIR))


def load(folder: Path, model, optimizer) -> None:
    """Read a checkpoint written by `save`, on this number of ranks (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, _inner(optimizer), options=_options())
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(Path(folder) / DCP_DIR))
    set_state_dict(
        model,
        _inner(optimizer),
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=_options(),
    )


def full_state_dict(model) -> dict:
    """The unsharded weights on rank 0 (fp32, on the CPU); {} on the other ranks. A collective: every rank
    calls."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(full=True))


def is_checkpoint(folder: Path) -> bool:
    return (Path(folder) / DCP_DIR / ".metadata").is_file()


def _inner(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the real one
