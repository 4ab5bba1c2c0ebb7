"""Every knob's valid values, one home: numeric ranges (LIMITS), closed sets and formats of strings
(CHOICES), the knobs a stage's own check() judges with other knobs (BY_STAGE), and the free-text ones
(FREE); and the keys the schema has (unknown_keys, is_setting). `problems(cfg)` lists every value outside
them; the runner refuses them for every command, before anything runs (issue #35, rule 1).
tests/unit/test_refuse_before_working.py walks every field of the schema: a new knob without an entry here
fails it, and a nonsense value of every knob is shown refused before work.

Keys are dotted config paths; `[]` stands for every element of a list (`eval.concurrency[]`) or of a list of
sections (`data.sources[].limit`). A null value is allowed where the schema allows it (Optional), and means
what the schema's comment says.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from omegaconf import DictConfig, ListConfig, OmegaConf

from pipeline.config import Config
from pipeline.config_tools import StageMinutes


@dataclass(frozen=True)
class Range:
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself is outside
    hi_open: bool = False

    def holds(self, v) -> bool:
        if isinstance(v, float) and not math.isfinite(v):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return not (self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi))

    def rule(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        return f"{'<' if self.hi_open else '<='} {self.hi:g}"


AT_LEAST_0, AT_LEAST_1, POSITIVE = Range(0), Range(1), Range(0, lo_open=True)
FRACTION = Range(0, 1, lo_open=True)  # (0, 1]: a share of GPU memory

LIMITS: dict[str, Range] = {
    "seed": AT_LEAST_0,
    **{
        f"target.{k}": AT_LEAST_1
        for k in (
            "num_layers",
            "hidden_size",
            "vocab_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "num_parameters",
        )
    },
    "data.limit": AT_LEAST_1,
    "data.seed": AT_LEAST_0,
    "prepare.max_len": Range(2),
    "prepare.max_assistant_turns": AT_LEAST_1,
    "prepare.regenerate_server.port": Range(1, 65535),
    "prepare.regenerate_server.startup_timeout_s": POSITIVE,
    "prepare.regenerate_server.mem_fraction": FRACTION,
    "prepare.max_new_tokens": AT_LEAST_1,
    "prepare.temperature": AT_LEAST_0,
    "prepare.gen_batch_size": AT_LEAST_1,
    "prepare.endpoint_concurrency": AT_LEAST_1,
    "prepare.endpoint_timeout_s": POSITIVE,
    "prepare.endpoint_retries": AT_LEAST_0,
    "prepare.endpoint_backoff_s": AT_LEAST_0,
    "prepare.synthesize": AT_LEAST_0,
    "prepare.synthesize_max_new_tokens": AT_LEAST_1,
    "prepare.synthesize_temperature": AT_LEAST_0,
    "prepare.synthesize_min_chars": AT_LEAST_0,
    "prepare.synthesize_max_chars": AT_LEAST_1,
    "extract.aux_layers[]": AT_LEAST_0,  # and below target.num_layers: capture/aux_layers.py
    "extract.sglang_mem_fraction": FRACTION,
    "extract.batch_tokens": AT_LEAST_1,
    "extract.max_batch_size": AT_LEAST_1,
    "extract.shard_tokens": AT_LEAST_1,
    "extract.write_workers": AT_LEAST_1,
    "extract.chunk_tokens": AT_LEAST_1,
    "extract.clevel": Range(0, 9),  # blosc's levels, for lz4 and zstd alike
    "extract.limit": AT_LEAST_1,  # 0 made a complete, empty store
    "vocab.draft_vocab_size": AT_LEAST_1,  # and <= the target's vocabulary: the vocab stage's check
    "train.eval_tau_every_steps": AT_LEAST_1,
    "train.ttt_steps": AT_LEAST_1,
    "train.ttt_step_loss_decay": POSITIVE,
    "train.loss_chunk_tokens": AT_LEAST_1,
    # a pack holds whole TTT windows: 1 or 2 tokens crashed inside the loss (issue #35)
    "train.tokens_per_pack": Range(16),
    "train.split_context": AT_LEAST_0,  # and below tokens_per_pack: train's check
    "train.grad_accum": AT_LEAST_1,
    "train.epochs": AT_LEAST_1,
    "train.max_steps": AT_LEAST_1,
    "train.lr": POSITIVE,
    "train.muon_lr": POSITIVE,
    **{"train.muon_momentum": Range(0, 1, hi_open=True), "train.muon_weight_decay": AT_LEAST_0},
    "train.weight_decay": AT_LEAST_0,
    "train.adam_betas[]": Range(0, 1, hi_open=True),
    "train.warmup_steps": AT_LEAST_0,
    "train.max_grad_norm": AT_LEAST_0,  # 0: no clipping; a negative norm flipped the gradient
    "train.val_fraction": Range(0, 1, hi_open=True),
    "train.val_every_steps": AT_LEAST_1,
    "train.log_every_steps": AT_LEAST_1,
    "train.save_every_steps": AT_LEAST_1,
    "train.keep_last": AT_LEAST_1,
    "train.num_workers": AT_LEAST_0,
    "export.serve.num_steps": AT_LEAST_1,  # these three go into serve.sh
    "export.serve.topk": AT_LEAST_1,
    "export.serve.num_draft_tokens": AT_LEAST_1,
    "eval.num_prompts": AT_LEAST_1,
    "eval.prompt_tokens": Range(2),
    "eval.first_answer_tokens": AT_LEAST_1,
    "eval.max_new_tokens": AT_LEAST_1,
    "eval.max_draft": AT_LEAST_1,
    "eval.batch_size": AT_LEAST_1,
    "eval.concurrency[]": AT_LEAST_1,
    "eval.repeats": AT_LEAST_1,
    "eval.warmup_prompts": AT_LEAST_0,
    "eval.endpoint_timeout_s": POSITIVE,
    "plan.world_size": AT_LEAST_1,
    "plan.gpu_memory_gib": POSITIVE,
    "tune.grid.num_steps[]": AT_LEAST_1,
    "tune.grid.topk[]": AT_LEAST_1,
    "tune.grid.num_draft_tokens[]": AT_LEAST_1,
    "tune.grid.cuda_graph_max_bs[]": AT_LEAST_1,
    "tune.objective_concurrency": AT_LEAST_1,
    "tune.start_timeout_s": POSITIVE,
    **dict.fromkeys(("submit.ranks", "submit.cpus_per_rank", "submit.mem_gb_per_rank"), AT_LEAST_1),
    "submit.gpus_per_rank": AT_LEAST_0,
    **{f"submit.time_min.{f.name}": AT_LEAST_1 for f in dataclasses.fields(StageMinutes)},
    "submit.signal_delay_s": AT_LEAST_0,
    "submit.poll_s": POSITIVE,
}

# extract.dtype's names -> torch's (auto: bf16 on a GPU, fp32 on the CPU)
DTYPES = {
    "auto": None,
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
    "float32": "float32",
}
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _device(key: str, v: str) -> str | None:
    if not _DEVICE.fullmatch(v):
        return f"{key}={v!r} is not a device: auto, cpu, cuda or cuda:N"
    return None


_ELSEWHERE: list[bool] = []  # set while checking for jobs that run on other nodes (`eaglepipe submit`)


@contextlib.contextmanager
def checking_for_another_node():  # `eaglepipe submit` on a login node: this node's CUDA is not the jobs'
    _ELSEWHERE.append(True)
    try:
        yield
    finally:
        _ELSEWHERE.pop()


def cuda_missing(key: str, v: str) -> str | None:
    """A CUDA device asked for where there is none (or not that many): the stage that runs on `key`'s device
    asks, so a CPU login node can still prepare with a GPU experiment's config."""
    if str(v).startswith("cuda") and not _ELSEWHERE:
        import torch

        if not torch.cuda.is_available():
            return f"{key}={v} but this machine has no CUDA; use {key}=auto or cpu"
        if ":" in v and int(v.split(":")[1]) >= torch.cuda.device_count():
            return f"{key}={v} but this machine has {torch.cuda.device_count()} CUDA devices"
    return None


def _one_of(options) -> Callable[[str, str], str | None]:
    return lambda key, v: None if v in options else f"{key}={v!r} is not one of {list(options)}"


def _extract_attention(key: str, v: str) -> str | None:
    if problem := _one_of(["sdpa", "eager", "flash_attention_2"])(key, v):
        return problem
    if v == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        return f"{key}=flash_attention_2 needs the flash-attn package, not installed here; use sdpa"
    return None


def _schedule(key: str, v: str) -> str | None:
    from transformers import SchedulerType

    return _one_of([s.value for s in SchedulerType])(key, v)


def _loss(key: str, v: str) -> str | None:
    from speculators.losses.utils import resolve_loss_config

    try:
        resolve_loss_config(v, "eager")
    except ValueError as e:
        return f"{key}={v!r}: {e}"
    return None


def _url(key: str, v: str) -> str | None:
    return None if re.match(r"https?://[^/\s]+", v) else f"{key}={v!r} is not a URL (http://host:port)"


def _directory(key: str, v: str) -> str | None:
    from pathlib import Path

    if not v.strip():
        return f"{key} is empty (an unset shell variable?): give it a directory"
    if Path(v).is_file():
        return f"{key}={v} is a file, not a directory: pick another {key}"
    return None


CHOICES: dict[str, Callable[[str, str], str | None]] = {
    "run_dir": _directory,  # `run_dir=$UNSET` wrote prepared/, stages.json, .hydra/ into the cwd
    "cache_dir": _directory,
    "extract.device": _device,
    "train.device": _device,
    "eval.device": _device,
    "extract.dtype": _one_of(list(DTYPES)),
    "extract.attn_implementation": _extract_attention,
    "train.schedule": _schedule,
    "train.loss": _loss,
    "plan.precision": _one_of(["bf16", "fp32"]),
    "engine": _one_of(["sglang", "vllm"]),
    "prepare.regenerate_endpoint": _url,
    "eval.endpoint": _url,
    "eval.baseline_endpoint": _url,
    "tune.baseline_endpoint": _url,
    "server": _url,
}

# knobs a stage's check() judges (it needs the stage's own tables, or names the list entry)
BY_STAGE = {
    "data.sources[].limit": "prepare",  # data/mixture.py check: >= 1, naming the source
    "data.sources[].weight": "prepare",  # > 0
    "data.sources[].heldout": "prepare",  # >= 0
    "train.attn_implementation": "train",
    "export.engines[]": "export",
    "eval.sets[]": "evaluate",
    "data.extra_sources[]": "prepare",
}

# free text: names, paths, launch lines, extra flags, environment (a path's existence is the reading stage's)
FREE = {
    "run_name",
    "target.name",
    "target.path",
    "data.name",
    "data.path",
    "data.split",
    *("data.sources[].name", "data.sources[].path", "prepare.answers[]"),  # (answers: read by prepare)
    "prepare.regenerate_model",
    "prepare.regenerate_server.python",
    "prepare.regenerate_server.env",
    "prepare.regenerate_server.args[]",
    "prepare.regenerate_server.command[]",
    "prepare.regenerate_server.host",
    "prepare.synthesize_system",
    "extract.sglang_attention_backend",
    "train.wandb.project",
    "train.wandb.name",
    *("export.serve.sglang_args[]", "export.serve.vllm_args[]", "export.sglang_python", "export.vllm_python"),
    "export_dir",
    "launch",
    "launch_file",
    "tune.grid.attention_backend[]",
    "tune.launch_prefix",
    "tune.server_args[]",
    *("submit.partition", "submit.account", "submit.qos"),  # SLURM's names: check_fits lists the partitions
}


def nearest_key(dotted: str) -> str | None:
    """The schema's key nearest to a misspelt one (`train.lrr` -> `train.lr`), or None."""
    import difflib
    import typing

    kind, parts, known = Config, dotted.replace("[]", "").split("."), []
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(kind)}
        if part not in fields:
            near = difflib.get_close_matches(part, list(fields), n=1)
            if not near and i == 0:  # a section's key given at the top (`+resume=never`)
                hints = typing.get_type_hints(Config)
                near = [
                    f"{k}.{part}"
                    for k, t in hints.items()
                    if dataclasses.is_dataclass(t) and part in t.__dataclass_fields__
                ]
            return ".".join([*known, near[0]]) if near else None
        known.append(part)
        hints = typing.get_type_hints(kind)
        kind = next(
            (a for a in [hints[part], *typing.get_args(hints[part])] if dataclasses.is_dataclass(a)), None
        )
        if kind is None:
            return None if i < len(parts) - 1 else dotted
    return dotted


def is_setting(dotted: str) -> bool:
    """`dotted` names a knob of the schema, or a key inside one of its free dicts (regenerate_server.env)."""
    import typing

    kind = Config
    for part in dotted.split("."):
        if kind is None:
            return False
        if kind is dict:
            return True
        if part not in {f.name for f in dataclasses.fields(kind)}:
            return False
        hint = typing.get_type_hints(kind)[part]
        options = [hint, *typing.get_args(hint)]
        kind = next((a for a in options if dataclasses.is_dataclass(a)), None) or next(
            (dict for a in options if a is dict or typing.get_origin(a) is dict), None
        )
    return True


def unknown_keys(cfg) -> list[str]:
    """Keys the schema does not have, e.g. added with `+` (`+train.lrr=1e-9`, `+resume=never`): Hydra adds
    them to any section and nothing reads them. One problem each, naming the nearest known key."""
    found = []

    def walk(node, prefix: str) -> None:
        kind = node._metadata.object_type
        if not dataclasses.is_dataclass(kind):
            return  # a free dict (regenerate_server.env)
        known = {f.name for f in dataclasses.fields(kind)}
        for key in node.keys():
            child = node._get_node(key)
            if key not in known:
                found.append(unknown_key(f"{prefix}{key}"))
            elif isinstance(child, DictConfig):
                walk(child, f"{prefix}{key}.")
            elif isinstance(child, ListConfig) and not child._is_none():
                for item in child:
                    if isinstance(item, DictConfig):
                        walk(item, f"{prefix}{key}[].")

    walk(cfg, "")
    return found


def unknown_key(dotted: str) -> str:
    near = nearest_key(dotted)
    hint = f"; did you mean {near}?" if near and near != dotted else ""
    return f"{dotted} is not a setting of eaglepipe{hint} (`eaglepipe --cfg job` lists every setting)"


def leaves(node, prefix: str = ""):
    """(key, value) of every leaf, `[]` for list elements: what LIMITS and CHOICES are keyed by."""
    if isinstance(node, DictConfig):
        for k in node.keys():
            if not OmegaConf.is_missing(
                node, k
            ):  # ??? (target.path of kimi_k25): the stage that reads it says
                yield from leaves(node[k], f"{prefix}{k}.")
    elif isinstance(node, ListConfig):
        for item in node if node._is_none() is False else [None]:
            yield from leaves(item, f"{prefix.rstrip('.')}[].")
    else:
        yield prefix.rstrip("."), node


def problems(cfg, judge=None) -> list[str]:
    """Every knob outside its range or set, one problem each; `judge(key, v)` may stand for CHOICES' checks
    (the runner's: a library's check only where its stage runs, remembered per version)."""
    found, judge = [], judge or (lambda key, v: CHOICES[key](key, v))
    for key, v in leaves(cfg):
        if v is None or isinstance(v, bool):
            continue
        if key in LIMITS and isinstance(v, (int, float)) and not LIMITS[key].holds(v):
            found.append(f"{key}={v} must be {LIMITS[key].rule()}")
        elif key in CHOICES and isinstance(v, str) and (problem := judge(key, v)):
            found.append(problem)
    return found
