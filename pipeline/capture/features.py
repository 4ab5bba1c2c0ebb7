"""Where the stages after extract read the target's hidden states from (`train.features`):

- `offline` (default): the feature store extract wrote (`features/`, docs/feature_store.md);
- `online`: the target itself, frozen, run on each pack as training needs it, with extract's capture code
  (pipeline/capture/hf.py: the same hooks, the same bf16 cast). No `features/` is written.

Both sources have one reading interface: `facts`, `aux_layer_ids`, `hidden_size`, `len()`, `sample_lengths()`,
`tokens(i)`, `sample(i)`, `iter_tokens()`, `manifest_hash()`. So vocab, train, export and evaluate do not know
which one they read. The facts (what produced the states) are built here for both: one home.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

from pipeline import __version__
from pipeline.capture.aux_layers import CONVENTION, aux_layer_ids
from pipeline.capture.hf import Capture, pad_batch, plan_batches
from pipeline.errors import UserError
from pipeline.fingerprint import digest
from pipeline.formats import feature_store as fs
from pipeline.formats import prepared
from pipeline.formats.run_dir import RunDir
from pipeline.models import targets

log = logging.getLogger(__name__)


def online(cfg) -> bool:
    from omegaconf import OmegaConf

    value = OmegaConf.select(cfg, "train.features", default="offline")
    return str(getattr(value, "value", value)) == "online"


def backend(cfg) -> str:
    return "hf" if online(cfg) else str(getattr(cfg.extract.backend, "value", cfg.extract.backend))


def fp8(cfg) -> bool:
    return str(getattr(cfg.extract.store_dtype, "value", cfg.extract.store_dtype)) == fs.FP8


def facts(
    cfg, folder: Path, model_cfg, tok, stats: dict, aux: list[int], dtype: torch.dtype, num_samples: int
) -> dict:
    """What produced the states: recorded in the store's manifest and every shard (offline), or held by the
    online source; later stages read these."""
    out = {
        "produced_by": f"eaglepipe {__version__}",
        "backend": backend(cfg),
        "target_name": cfg.target.name,
        "target_path": str(folder),
        "target_fingerprint": targets.fingerprint(folder),
        "num_layers": model_cfg.num_hidden_layers,
        "hidden_size": model_cfg.hidden_size,
        "vocab_size": model_cfg.vocab_size,
        "aux_layer_ids": aux,
        "layer_id_convention": CONVENTION,
        "last_hidden": f"pre-norm output of decoder layer {model_cfg.num_hidden_layers - 1}",
        "logical_dtype": fs.LOGICAL_DTYPE,
        "compute_dtype": str(dtype).replace("torch.", ""),
        "chat_template_hash": targets.chat_template_hash(tok),
        "max_len": stats["max_len"],
        "prepared_fingerprint": stats["prepared_fingerprint"],
        "num_samples": num_samples,
        "shard_tokens": cfg.extract.shard_tokens,
        **({"store_dtype": fs.FP8} if fp8(cfg) and not online(cfg) else {}),  # absent = bf16, as before fp8
    }
    if online(cfg):
        out.pop("shard_tokens")
        out["source"] = "online"  # computed in training, never written
    return out


def capture_inputs(cfg):
    """What capturing states needs, checked once for extract and the online source alike: (target folder, its
    config, aux ids, the prepared dataset, its stats, the tokenizer)."""
    folder = targets.resolve(cfg.target, cfg.cache_dir)
    model_cfg = targets.load_config(folder, cfg.target)
    aux = aux_layer_ids(cfg.extract.aux_layers, model_cfg.num_hidden_layers)
    ds, stats = prepared.load(cfg.run_dir, cfg.extract.limit)
    if stats["target_fingerprint"] != targets.fingerprint(folder):
        raise UserError(
            f"prepared data in {cfg.run_dir}/prepared was tokenized for another target "
            f"({stats['target_path']}); rerun stage=prepare or use another run_dir"
        )
    return folder, model_cfg, aux, ds, stats, targets.load_tokenizer(folder, cfg.target)


def online_problem(cfg) -> str | None:
    """Why these settings cannot train online (None: they can)."""
    if online(cfg) and (fp8(cfg) or str(getattr(cfg.extract.backend, "value", cfg.extract.backend)) != "hf"):
        return (
            "train.features=online captures with the hf backend in bf16; extract.backend=sglang and "
            "extract.store_dtype=fp8_e4m3 describe a feature store: use train.features=offline"
        )
    return None


def open_source(cfg):
    """The states the later stages read: the feature store (offline) or the online source."""
    if not online(cfg):
        return RunDir.of(cfg).open_features()
    return OnlineFeatures.of(cfg)


def fingerprint_text(cfg) -> str | None:
    """What downstream fingerprints hash for the states: the store's manifest text, or the online facts."""
    if online(cfg):
        try:
            return json.dumps(OnlineFeatures.of(cfg).facts, sort_keys=True)
        except UserError:
            return None  # nothing prepared yet: the stage that needs it says so when it runs
    manifest = RunDir.of(cfg).features / fs.MANIFEST
    return manifest.read_text(errors="replace") if manifest.exists() else None  # damaged: extract says so


class OnlineFeatures(fs.FactsView):
    """The feature store's reading interface over prepared/ and the target: `tokens(i)` reads prepared/ only;
    `sample(i)` (and `prefetch` for a whole pack, in one padded forward) runs the target on `device`."""

    def __init__(
        self,
        facts: dict,
        ds,
        folder: Path,
        target_cfg,
        device: torch.device,
        dtype: torch.dtype,
        attn: str,
        batch_tokens: int = 16384,
        max_batch_size: int = 64,
    ):
        self.facts, self._ds, self._folder, self._target_cfg = facts, ds, folder, target_cfg
        self.device, self._dtype, self._attn = device, dtype, attn
        self._batch_tokens, self._max_batch = batch_tokens, max_batch_size  # extract's batch limits
        self._capture: Capture | None = None
        self._cache: dict[int, dict] = {}
        self.root = None  # no files: a DataLoader gets this object, not a path

    @classmethod
    def of(cls, cfg) -> OnlineFeatures:
        """The source for these settings; nothing heavy is loaded (the target waits for the first states)."""
        if problem := online_problem(cfg):
            raise UserError(problem)
        ex = cfg.extract
        folder, model_cfg, aux, ds, stats, tok = capture_inputs(cfg)
        device, dtype = targets.pick_device_dtype(cfg.train.device, ex.dtype)
        return cls(
            facts(cfg, folder, model_cfg, tok, stats, aux, dtype, len(ds)),
            ds,
            folder,
            cfg.target,
            device,
            dtype,
            ex.attn_implementation,
            ex.batch_tokens,
            ex.max_batch_size,
        )

    # ---- the FeatureStore's reading interface (aux_layer_ids, hidden_size: fs.FactsView)
    def __len__(self) -> int:
        return len(self._ds)

    def manifest_hash(self) -> str:
        """Stands for the store's manifest hash (vocab records it, train checks it). Without compute_dtype: it
        follows the host (fp32 on a CPU, bf16 on a GPU), and vocab may well run on another host than train."""
        return digest({k: v for k, v in self.facts.items() if k != "compute_dtype"})

    def sample_lengths(self) -> np.ndarray:
        return np.array([len(x) for x in self._ds["input_ids"]], dtype=np.int64)

    def tokens(self, i: int) -> dict[str, torch.Tensor]:
        row = self._ds[int(i)]
        return {
            "input_ids": torch.tensor(row["input_ids"], dtype=torch.long),
            "loss_mask": torch.tensor(row["loss_mask"], dtype=torch.uint8),
        }

    def iter_tokens(self):
        for ids, mask in zip(self._ds["input_ids"], self._ds["loss_mask"]):
            yield np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8)

    def sample(self, i: int) -> dict[str, torch.Tensor]:
        if i not in self._cache:
            self.prefetch([i])
        return self._cache[i]

    # ---- online only
    def prefetch(self, ids: list[int]) -> None:
        """The states of these samples in padded forwards batched as extract batches (plan_batches); the cache
        holds only these afterwards (a pack's samples)."""
        keep = {i: self._cache[i] for i in ids if i in self._cache}
        need = sorted({int(i) for i in ids} - set(keep), key=lambda i: (-len(self._ds[i]["input_ids"]), i))
        rows = {i: self.tokens(i) for i in need}
        for group in plan_batches(
            [len(rows[i]["input_ids"]) for i in need], self._batch_tokens, self._max_batch
        ):
            ids = [need[j] for j in group]
            input_ids, attn = pad_batch([rows[i]["input_ids"] for i in ids])
            capture = self._target()
            aux, last = capture(input_ids.to(self.device), attn.to(self.device))
            for r, i in enumerate(ids):
                n = len(rows[i]["input_ids"])
                keep[i] = {**rows[i], "aux_hidden": aux[r, :n].clone(), "last_hidden": last[r, :n].clone()}
            capture.release()  # the padded states: not kept through the draft's forward and backward
        self._cache = keep

    def _target(self) -> Capture:
        if self._capture is None:  # loaded on the first states asked for: vocab/export/evaluate never load it
            log.info(
                "online features: the target %s on %s (%s), frozen",
                self._folder,
                self.device,
                str(self._dtype).replace("torch.", ""),
            )
            model = targets.load_model(self._folder, self._target_cfg, self.device, self._dtype, self._attn)
            model.requires_grad_(False)
            self._capture = Capture(model, self.aux_layer_ids)
        return self._capture
