"""The capture loop: prepared samples through the target (hf hooks or SGLang's ModelRunner) into the feature
store, shard by shard: length-bucketed batches, copies to the host overlapped with compute, a shard committed
while the next computes; data-parallel ranks (hf) or tensor-parallel ranks (sglang); resume and repair.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from pipeline.capture import features
from pipeline.capture.hf import Capture, plan_batches
from pipeline.capture.settings import backend
from pipeline.errors import UserError
from pipeline.formats import feature_store as fs
from pipeline.formats import shard_regions, store_check
from pipeline.formats import store_writer as sw
from pipeline.formats.run_dir import RunDir
from pipeline.models import targets

log = logging.getLogger(__name__)


def out_dir(cfg) -> Path:
    return RunDir.of(cfg).features


def plan_shards(lengths: np.ndarray, shard_tokens: int) -> list[sw.ShardSpec]:
    """Contiguous sample ranges; a shard closes when the next sample would push it past shard_tokens."""
    shards, start, current = [], 0, []
    for i, n in enumerate(lengths.tolist()):
        if current and sum(current) + n > shard_tokens:
            shards.append(sw.ShardSpec(len(shards), start, current))
            start, current = i, []
        current.append(n)
    if current:
        shards.append(sw.ShardSpec(len(shards), start, current))
    return shards


def ranks() -> tuple[int, int]:
    """(rank, world size) under torchrun / accelerate launch; (0, 1) in one process."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _rank_device(device: torch.device) -> torch.device:
    """Data-parallel capture: one GPU per process (LOCAL_RANK); on CPU every rank shares the host."""
    if device.type != "cuda":
        return device
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def _process_group():
    """The ranks of a data-parallel extract meet at two barriers (the store opened; every shard committed): a
    gloo group, whatever the device, since nothing but the barriers crosses between ranks."""
    import torch.distributed as dist

    if not dist.is_initialized():  # rank 0 may verify or delete a whole store before the first barrier: hours
        dist.init_process_group("gloo", timeout=timedelta(hours=24))
    return dist


def _drop_damaged(cfg, facts: dict) -> None:
    """extract.repair=true: shards with a damaged, truncated or missing chunk or metadata leave the manifest
    (and are then extracted again, like shards a killed run never committed); a manifest that cannot be read
    is rebuilt from the shards that verify against their own metadata (formats/store_check.py)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    try:
        bad = store_check.verify_store(out_dir(cfg))
    except fs.ManifestDamaged as e:
        try:
            kept, redo = store_check.rebuild_manifest(out_dir(cfg), facts)
        except fs.StoreError as other:  # shards of other inputs
            raise UserError(f"extract.repair=true: {other}") from None
        msg = "extract: repair: %s was damaged (%s): rebuilt from %d shard(s) that verify, %d to extract anew"
        log.warning(msg, e.path, e.what, len(kept), len(redo))
        return
    except fs.StoreError as e:
        raise UserError(f"extract.repair=true: {e}; run stage=extract without repair") from None
    names = sorted({b["shard"] for b in bad})
    log.warning(
        "extract: repair: %d damaged chunk(s) in %d shard(s)%s",
        len(bad),
        len(names),
        f": extracting {', '.join(names)} again" if names else "; nothing to redo",
    )
    if names:
        with fs.manifest_lock(out_dir(cfg)):
            manifest = fs.read_manifest(out_dir(cfg))
            manifest["shards"] = [s for s in manifest["shards"] if s["name"] not in names]
            manifest["complete"] = False
            fs.write_manifest(out_dir(cfg), manifest)


def _open_store(cfg, facts: dict, data_parallel: bool = False) -> dict:
    """Rank 0 opens (or resumes) the store, cleaning what a killed run left; the other ranks read its manifest
    once it has (data parallel: after a barrier; SGLang's tensor-parallel ranks: by polling, they share no
    group with eaglepipe)."""
    rank, _ = ranks()
    if rank == 0 or backend(cfg) != "sglang" and not data_parallel:
        manifest = sw.open_for_writing(out_dir(cfg), facts, overwrite=cfg.extract.overwrite)
        if data_parallel:
            _process_group().barrier()
        return manifest
    if data_parallel:
        _process_group().barrier()
        manifest = fs.read_manifest(out_dir(cfg))
        if not manifest or manifest.get("facts") != json.loads(json.dumps(facts)):
            raise UserError(
                f"rank {rank}: the feature store rank 0 opened was made from other inputs than this rank's"
            )
        return manifest
    for _ in range(600):
        try:
            manifest = fs.read_manifest(out_dir(cfg))
        except fs.ManifestDamaged:  # rank 0 rebuilds it first (extract.repair=true)
            manifest = None
        if manifest and manifest.get("facts") == facts:
            return manifest
        time.sleep(1)
    raise UserError("rank 0 did not open the feature store within 600 s")


def _sglang_capture(folder: Path, aux: list[int], model_cfg, ex):
    """SGLang's ModelRunner on this rank (torchrun: one process per tensor-parallel rank; pipeline/engines/
    sglang_capture.py). Returns (capture, rank)."""

    from pipeline.engines import sglang_capture as sc

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    try:
        sc.target_class(model_cfg.architectures[0])
    except sc.CaptureUnsupported as e:
        raise UserError(str(e)) from None
    runner = sc.build_runner(
        str(folder),
        rank,
        world,
        int(os.environ.get("EAGLEPIPE_NCCL_PORT", 29517)),
        ex.sglang_mem_fraction,
        ex.sglang_attention_backend,
    )
    return sc.SGLangCapture(runner, aux), rank


def to_host(t: torch.Tensor):
    """(host tensor, event): on CUDA an asynchronous copy into pinned memory, done when the event is."""
    if t.device.type != "cuda":
        return t, None
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return out, event


def _scatter(writer, ids_all, mask_all, batch: list[int], lengths: list[int], copied) -> None:
    """A copied batch into the shard's host buffer, sample by sample, once its copy has landed. `copied`: the
    (host tensor, event) of aux and last, then (fp8 store) of their scales."""
    for _, event in copied:
        if event is not None:
            event.synchronize()
    parts = [t.split(lengths) for t, _ in copied]
    for j, i in enumerate(batch):
        scales = (parts[2][j], parts[3][j]) if len(parts) == 4 else None
        writer.write(i, np.asarray(ids_all[i]), np.asarray(mask_all[i]), parts[0][j], parts[1][j], scales)


def _shard_writer(cfg, spec, facts: dict, widths: tuple[int, int], shared: bool):
    """The shard's writer; with shared buffers where asked and /dev/shm has room for them now (else its
    own)."""
    ex = cfg.extract
    args = (
        out_dir(cfg),
        spec,
        facts,
        widths,
        ex.chunk_tokens,
        str(getattr(ex.compressor, "value", ex.compressor)),
        ex.clevel,
    )
    writer = str(getattr(ex.writer, "value", ex.writer))
    if shared:
        try:
            return sw.ShardWriter(*args, shared=True, writer=writer)
        except OSError:  # posix_fallocate: another process took the room since the check
            pass
    return sw.ShardWriter(*args, writer=writer)


def _writer_processes(ex, widths: tuple[int, int], fp8: bool):
    """extract.write_workers > 1: that many processes encode and write every shard's chunks, the shard
    buffers in shared memory (docs/feature_store.md, writing protocol 5: what they give, measured); None (this
    process writes)
    where there is one worker, or /dev/shm cannot hold the two shards in flight (said in the log)."""
    if ex.write_workers <= 1:
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # data-parallel ranks of this node share its /dev/shm
    need = 2 * local * sw.ShardWriter.shared_bytes(ex.shard_tokens, widths, fp8)
    free = shard_regions.shm_free_bytes()
    if free < need:
        log.warning(
            "extract.write_workers=%d: %s has %.1f GB free, two shards in flight on %d rank(s) need %.1f GB "
            "(extract.shard_tokens=%d); this process writes every shard",
            ex.write_workers,
            shard_regions.SHM_DIR,
            free / 1e9,
            local,
            need / 1e9,
            ex.shard_tokens,
        )
        return None
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn: the writers never touch CUDA nor inherit the target; they import numpy and zarr only
    pool = ProcessPoolExecutor(
        max_workers=ex.write_workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=shard_regions.watch_parent,
    )
    for _ in range(ex.write_workers):
        pool.submit(shard_regions.ready)  # the processes start while the first shard computes
    log.info("extract: %d writer processes, shard buffers in %s", ex.write_workers, shard_regions.SHM_DIR)
    return pool


def extract_shards(
    cfg, ds, todo, capture, facts, manifest, hidden: int, n_aux: int, write: bool = True
) -> None:
    """Every shard of `todo`: its samples through `capture.packed` (capture.hf.Capture or SGLangCapture) in
    length-bucketed batches, copied to the host while the next batch computes, committed while the next shard
    computes."""
    ex = cfg.extract
    fp8 = features.fp8(cfg)
    t0, tokens_done = time.time(), 0
    bar = tqdm(total=int(sum(sum(s.lengths) for s in todo)), desc="extract", unit="tok", mininterval=1.0)
    commits: deque[Future] = deque()
    widths = (n_aux * hidden, hidden)
    procs = _writer_processes(ex, widths, fp8) if write else None
    # writer: the shard being filled (not yet handed to a commit); in_process: shards /dev/shm had no room
    # for. Committing shard k (its chunks encoded and written by extract.write_workers processes) overlaps
    # computing k+1.
    writer, in_process = None, 0
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="extract-commit") as commit_thread:
            for spec in todo:
                writer = _shard_writer(cfg, spec, facts, widths, shared=procs is not None)
                if procs is not None and writer.shared is None:
                    in_process += 1
                rows = ds.select(range(spec.sample_start, spec.sample_end))
                ids_all, mask_all = rows["input_ids"], rows["loss_mask"]
                pending = None  # the previous batch: its copy to the host runs while this batch computes
                for batch in plan_batches(spec.lengths, ex.batch_tokens, ex.max_batch_size):
                    rows = list(
                        capture.packed([ids_all[i] for i in batch])
                    )  # the real tokens only, on the device
                    if not write:
                        continue
                    ns = [spec.lengths[i] for i in batch]
                    if fp8:  # encoded on the device: half the bytes cross to the host
                        (a_bits, a_scale), (l_bits, l_scale) = (
                            fs.encode_fp8(rows[0], n_aux),
                            fs.encode_fp8(rows[1], 1),
                        )
                        rows = [a_bits, l_bits, a_scale, l_scale]
                    copied = [to_host(r) for r in rows]
                    if pending is not None:
                        _scatter(writer, ids_all, mask_all, *pending)
                    pending = (batch, ns, copied)
                    bar.update(int(sum(ns)))
                if pending is not None:
                    _scatter(writer, ids_all, mask_all, *pending)
                while commits:
                    commits.popleft().result()  # one shard committing while the next one computes
                if write:
                    commits.append(
                        commit_thread.submit(
                            writer.commit, manifest, procs if writer.shared is not None else None
                        )
                    )
                    writer = None  # the commit owns it now (and releases it)
                tokens_done += sum(spec.lengths)
                bar.set_postfix(shard=spec.index, tok_s=f"{tokens_done / (time.time() - t0):.0f}")
            while commits:
                commits.popleft().result()
    finally:
        if writer is not None:  # a shard that failed while filling: its (shared) buffers go now
            writer.discard()
        if procs is not None:
            procs.shutdown(cancel_futures=True)
    if in_process:
        log.warning(
            "extract: %d shard(s) written by this process alone: %s had no room for their buffers",
            in_process,
            shard_regions.SHM_DIR,
        )
    bar.close()
    log.info(
        "extract: %d tokens written in %.1f s (%.0f tokens/s)",
        tokens_done,
        time.time() - t0,
        tokens_done / max(time.time() - t0, 1e-9),
    )


def extract(cfg) -> Path:
    """The prepared samples of cfg's run dir through the target (extract.backend) into its feature store:
    resumed at the first shard not committed, marked complete when every planned shard is. Returns the
    store's folder."""
    ex = cfg.extract
    folder, model_cfg, aux, ds, stats, tok = features.capture_inputs(cfg)
    rank, world = ranks()
    data_parallel = world > 1 and backend(cfg) == "hf"  # sglang: the ranks are ONE tensor-parallel engine
    device, dtype = targets.pick_device_dtype(ex.device, ex.dtype)
    if data_parallel:
        device = _rank_device(device)
        group = _process_group()
    lengths = np.array([len(x) for x in ds["input_ids"]], dtype=np.int64)
    facts = features.facts(cfg, folder, model_cfg, tok, stats, aux, dtype, len(lengths))
    if ex.repair:
        _drop_damaged(cfg, facts)
    try:
        manifest = _open_store(cfg, facts, data_parallel)
    except fs.Damaged as e:  # its own fix
        raise UserError(str(e)) from None
    except fs.StoreError as e:
        raise UserError(f"{e}; use a new run_dir or pass extract.overwrite=true to replace it") from None
    shards = plan_shards(lengths, ex.shard_tokens)
    done = {s["sample_start"]: s for s in manifest["shards"]}
    todo = [s for s in shards if s.sample_start not in done]
    log.info(
        "extract: %d samples, %d tokens, %d shards (%d already committed), aux layers %s, %s on %s",
        len(lengths),
        lengths.sum(),
        len(shards),
        len(shards) - len(todo),
        aux,
        facts["compute_dtype"],
        device,
    )
    if data_parallel:  # rank r takes the shards r, r+N, ... of those not yet committed, and commits its own
        todo = todo[rank::world]
        log.info(
            "extract: data parallel, rank %d of %d: %d shard(s), %d tokens",
            rank,
            world,
            len(todo),
            sum(sum(s.lengths) for s in todo),
        )
    if todo and backend(cfg) == "sglang":
        capture, rank = _sglang_capture(folder, aux, model_cfg, cfg.extract)
        extract_shards(
            cfg, ds, todo, capture, facts, manifest, model_cfg.hidden_size, len(aux), write=rank == 0
        )
        capture.remove()
        if rank != 0:
            return out_dir(cfg)  # tensor-parallel ranks compute; rank 0 writes the store
    elif todo:
        model = targets.load_model(folder, cfg.target, device, dtype, ex.attn_implementation)
        capture = Capture(model, aux)
        extract_shards(cfg, ds, todo, capture, facts, manifest, model_cfg.hidden_size, len(aux))
        capture.remove()
    if data_parallel:
        group.barrier()  # every rank's shards are committed
        if rank != 0:
            return out_dir(cfg)
    with fs.manifest_lock(out_dir(cfg)):
        manifest = fs.read_manifest(out_dir(cfg))
        missing = {s.sample_start for s in shards} - {s["sample_start"] for s in manifest["shards"]}
        if missing:  # never marked complete with a hole (a rank that returned early would leave one)
            raise RuntimeError(
                f"extract: {len(missing)} planned shard(s) are not in the manifest at the end "
                f"(first at sample {min(missing)})"
            )
        manifest["complete"] = True
        fs.write_manifest(out_dir(cfg), manifest)
    return out_dir(cfg)
