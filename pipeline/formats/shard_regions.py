"""One shard written by several processes: its host buffers live in POSIX shared memory, and each writer
process encodes and writes a chunk-aligned token range of an array (zarr writes disjoint chunks
independently).

Why processes: on the H200 two or four commit threads made extract slower than one. What processes give,
measured there (docs/feature_store.md, writing protocol 5): 1.6x into /dev/shm, nothing on that VM's disk,
whose limit lies outside any one process; on a 2-core CPU one process already keeps 1.3-1.6 cores busy. The
format is unchanged: the chunks are byte for byte those one process writes. Pure: numpy and zarr only, no
torch (the writer processes import this module alone).
"""

from __future__ import annotations

import os
from multiprocessing import shared_memory

import numpy as np
import zarr

SHM_DIR = "/dev/shm"
ALL_CHUNKS = {"write_empty_chunks": True}  # feature_store's: every chunk is written, even an all-zero one


def shm_free_bytes() -> int:
    """Bytes free in /dev/shm (0 where there is none): containers often cap it at 64 MB."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


class SharedArrays:
    """Named zero-filled numpy arrays in shared memory, owned by the process that made them; `handle(name)` is
    what a writer process needs to attach one. `release()` unmaps and unlinks them: no view of them may be
    used
    after it (numpy does not pin the mapping; a read would fault). A run killed with its segments is cleaned
    by the
    resource tracker once the last writer process is gone (writers exit with their parent: `watch_parent`).
    The pages are reserved when made (posix_fallocate), so a full /dev/shm is an OSError here, never a SIGBUS
    later."""

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], np.dtype]]):
        self.segments: dict[str, shared_memory.SharedMemory] = {}
        self.arrays: dict[str, np.ndarray] = {}
        try:
            for name, (shape, dtype) in specs.items():
                size = max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize)
                self.segments[name] = shared_memory.SharedMemory(create=True, size=size)
                os.posix_fallocate(self.segments[name]._fd, 0, size)
                self.arrays[name] = np.ndarray(shape, dtype, buffer=self.segments[name].buf)
        except BaseException:
            self.release()
            raise

    def handle(self, name: str) -> tuple[str, tuple[int, ...], str]:
        a = self.arrays[name]
        return self.segments[name].name, a.shape, a.dtype.str

    def release(self) -> None:
        self.arrays.clear()
        for seg in self.segments.values():
            seg.close()
            seg.unlink()
        self.segments.clear()


def regions(total: int, chunk: int, pieces: int) -> list[tuple[int, int]]:
    """[start, stop) token ranges covering `total`, each a whole number of chunks (the last may end short),
    at most
    `pieces` of them: no two writers ever touch one chunk."""
    chunks = -(-total // chunk)
    per = max(1, -(-chunks // max(1, pieces)))
    return [(i * chunk, min(total, (i + per) * chunk)) for i in range(0, chunks, per)]


def write_region(array_path: str, handle: tuple[str, tuple[int, ...], str], start: int, stop: int) -> None:
    """Rows start:stop of the shared buffer `handle` into the zarr array at `array_path` (already created,
    with its
    codecs); run in a writer process."""
    seg_name, shape, dtype = handle
    seg = shared_memory.SharedMemory(name=seg_name)
    try:
        view = np.ndarray(shape, np.dtype(dtype), buffer=seg.buf)
        zarr.open_array(array_path, mode="r+").with_config(ALL_CHUNKS)[start:stop] = view[start:stop]
        del view
    finally:
        seg.close()


def ready() -> int:
    """A no-op a new pool runs once per process, so the processes start while the first shard computes."""
    return os.getpid()


def watch_parent() -> None:
    """Pool initializer: the writer process exits when the process that started it is gone (killed extract: no
    orphan writers holding the resource tracker, and with it the shared memory, alive)."""
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="watch-parent").start()
