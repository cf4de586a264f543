"""Two processes, one NIXL transfer: the data plane measured without an engine.

The target process owns a KV buffer laid out as `KVLayout` says (regions of
blocks), filled with a known pattern, registered with NIXL; the initiator owns
a buffer of the same size and READs the target's into it, as a decode worker
pulls a prefill worker's blocks. Each process starts with the UCX settings it
is given (they are read once, when UCX starts), so every setting gets fresh
processes. Agents exchange metadata over a pipe: NIXL's own listener is off.

Three ways to move the same bytes:
- `contiguous`: one descriptor for the whole buffer (the data plane's best case);
- `blocks`: one descriptor per block per region, as the connector posts them,
  the request's block ids scattered over the region (a long-running engine's
  free list) so that no two descriptors merge;
- `blocks_sequential`: the same descriptors with the block ids in order (a
  fresh engine), which NIXL may merge into fewer, longer ones.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import statistics
import time
from dataclasses import dataclass

import numpy as np

from .kv_layout import KVLayout

WAYS = ("contiguous", "blocks", "blocks_sequential")


@dataclass(frozen=True, slots=True)
class Setting:
    """One NIXL/UCX configuration to measure."""

    name: str
    env: tuple[tuple[str, str], ...] = ()
    num_threads: int = 0             # the UCX backend's worker threads (0: NIXL's default)

    def describe(self) -> dict:
        return {"name": self.name, "env": dict(self.env), "num_threads": self.num_threads}


def _agent(name: str, num_threads: int):
    from nixl._api import nixl_agent, nixl_agent_config
    return nixl_agent(name, nixl_agent_config(num_threads=num_threads))


def _pattern(buf: np.ndarray) -> None:
    """Every 8-byte word holds its own index: a misplaced block cannot go unnoticed."""
    words = buf.view(np.uint64)
    words[:] = np.arange(words.size, dtype=np.uint64)


def _buffer(nbytes: int) -> np.ndarray:
    buf = np.empty(nbytes, dtype=np.uint8)
    buf[::4096] = 0                   # touch every page before registering it
    return buf


def _descs(buf: np.ndarray, layout: KVLayout, nblocks: int) -> np.ndarray:
    """(address, length, device) of every block of every region, region-major."""
    base = buf.ctypes.data
    starts = base + np.arange(layout.regions * nblocks, dtype=np.int64) * layout.block_bytes
    return np.stack([starts, np.full_like(starts, layout.block_bytes),
                     np.zeros_like(starts)], axis=1)


def _target(conn, setting: Setting, layout: KVLayout, nblocks: int) -> None:
    os.environ.update(dict(setting.env))
    buf = _buffer(layout.regions * nblocks * layout.block_bytes)
    _pattern(buf)
    agent = _agent("target", setting.num_threads)
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    conn.recv()                       # the initiator is done
    conn.close()


def _ids(nblocks: int, regions: int, order: np.ndarray) -> np.ndarray:
    """Descriptor indices of `order`'s blocks in every region."""
    return (np.arange(regions, dtype=np.int32)[:, None] * nblocks + order[None, :]).ravel()


def _initiator(conn, result, setting: Setting, layout: KVLayout, nblocks: int,
               reps: int) -> None:
    os.environ.update(dict(setting.env))
    nbytes = layout.regions * nblocks * layout.block_bytes
    buf = _buffer(nbytes)
    agent = _agent("initiator", setting.num_threads)
    agent.register_memory([(buf.ctypes.data, nbytes, 0, "")], "DRAM")
    metadata, remote_base = conn.recv()
    remote = agent.add_remote_agent(metadata)
    rng = np.random.default_rng(0)
    whole_local = agent.get_xfer_descs([(buf.ctypes.data, nbytes, 0)], "DRAM")
    whole_remote = agent.get_xfer_descs([(remote_base, nbytes, 0)], "DRAM")
    local_side = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _descs(buf, layout, nblocks), "DRAM")
    remote_descs = _descs(buf, layout, nblocks)
    remote_descs[:, 0] += remote_base - buf.ctypes.data
    remote_side = agent.prep_xfer_dlist(remote, remote_descs, "DRAM")
    seconds: dict[str, list[float]] = {w: [] for w in WAYS}
    for way in WAYS:
        if way == "blocks":
            src, dst = rng.permutation(nblocks), rng.permutation(nblocks)
        else:
            src = dst = np.arange(nblocks)
        for rep in range(reps + 1):   # the first is a warm-up (connection set-up)
            buf[:] = 0
            started = time.perf_counter()
            if way == "contiguous":
                handle = agent.initialize_xfer("READ", whole_local, whole_remote, remote)
            else:
                handle = agent.make_prepped_xfer(
                    "READ", local_side, _ids(nblocks, layout.regions, dst),
                    remote_side, _ids(nblocks, layout.regions, src))
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            elapsed = time.perf_counter() - started
            agent.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError(f"{setting.name} {way}: transfer ended {state}")
            if rep:
                seconds[way].append(elapsed)
        _verify(buf, layout, nblocks, src, dst, rng)
    conn.send("done")
    result.put({w: statistics.median(s) for w, s in seconds.items()})


def _verify(buf: np.ndarray, layout: KVLayout, nblocks: int, src: np.ndarray, dst: np.ndarray,
            rng: np.random.Generator) -> None:
    """Spot-check 64 blocks: local block dst[k] of each sampled region must hold the
    target's block src[k] (whose words are their own indices there)."""
    words_per_block = layout.block_bytes // 8
    local = buf.view(np.uint64)
    for _ in range(64):
        region, k = rng.integers(layout.regions), rng.integers(nblocks)
        at = (region * nblocks + dst[k]) * words_per_block
        want = (region * nblocks + src[k]) * words_per_block
        got = local[at:at + words_per_block]
        if not np.array_equal(got, np.arange(want, want + words_per_block, dtype=np.uint64)):
            raise RuntimeError(f"block {k} of region {region} arrived wrong")


def measure(setting: Setting, layout: KVLayout, tokens: int, reps: int) -> dict[str, float]:
    """Median seconds of each way of moving `tokens` tokens' KV between two fresh processes."""
    ctx = mp.get_context("spawn")
    nblocks = layout.blocks(tokens)
    a, b = ctx.Pipe()
    result = ctx.Queue()
    target = ctx.Process(target=_target, args=(a, setting, layout, nblocks), daemon=True)
    initiator = ctx.Process(target=_initiator, args=(b, result, setting, layout, nblocks, reps),
                            daemon=True)
    target.start()
    initiator.start()
    try:
        while True:
            try:
                return result.get(timeout=1.0)
            except queue.Empty:
                for p in (initiator, target):
                    if p.exitcode is not None and p.exitcode != 0:
                        raise RuntimeError(f"{setting.name}: a NIXL process exited "
                                           f"({p.exitcode})") from None
    finally:
        for p in (initiator, target):
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()


def memcpy_seconds(nbytes: int, reps: int) -> float:
    """Median seconds of one in-process copy of `nbytes` (the limit on this machine)."""
    src, dst = _buffer(nbytes), _buffer(nbytes)
    src[:] = 1
    times = []
    for _ in range(reps + 1):
        started = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])
