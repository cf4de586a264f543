"""vLLM's NIXL connectors, pull and push, tuned for pdserve's deployments.

vLLM loads these classes through `kv_connector_module_path` (see connector.py).
They keep the names `NixlConnector` (pull: the decode engine READs the blocks)
and `NixlPushConnector` (push: the prefill engine WRITEs them) on purpose:
vLLM's config checks look the connector up by those names. Four things differ
from vLLM's own, alike in both:

1. The NIXL progress thread sleeps when idle. NIXL's Python agent hard-codes
   `pthrDelay = 0`, so the UCX progress thread calls poll() with a zero
   timeout and spins a whole core even when no transfer is in flight (measured
   here: a 0.35 s request took 9 s; idle workers at ~90% CPU each). With
   `progress_poll_us` in the connector's extra config the thread blocks in
   poll() on UCX's event fds for up to that long instead: it still wakes at
   once for traffic. (Turning the thread off is not an option: vLLM's
   handshake relies on it and the engine hangs.)

2. The engine keeps the cores its worker was given. On CPU, vLLM's worker-side
   connector calls `os.sched_setaffinity(0, <last core of each NUMA node>)`
   ("reserve different cores for start_load_kv") on the model-runner thread.
   On a box where each engine owns a core, that moves the prefill engine's
   compute thread onto the decode engine's core, where vLLM's worker
   busy-waits after each step (measured: 3.7x TTFT, 2.6x TPOT). pdserve pins
   each worker to its cores itself, so the constructor puts every thread of the
   engine process that vLLM moved outside those cores back inside them.

3. An idle engine stops spinning after `idle_spin_ms` instead of a second
   (see `limit_idle_spin`).

4. On a prefill engine, every lease (the blocks held for a decoder) can be
   ended or claimed by id and ends with one counted outcome (`leases.py`).

And the pull connector's decode side loads no more of a prompt than the
prefill computed (`remote_num_tokens` in its params): a decode request may
then carry the prompt plus the token the prefill sampled, and its engine
computes that token's KV itself where vLLM's would read the prefill's
unwritten slot for it (or meet a block the prefill never had). That is
what lets the edge stream the prefill's token at once (`continues_prefill`
in the worker's registration).
"""
from __future__ import annotations

import os
import sys
import types

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlConnector as _VllmNixlConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlPushConnector as _VllmNixlPushConnector,
)

from .leases import Leases
from .params import computed_tokens, pulls_blocks


class _BindingsWithPollDelay(types.ModuleType):
    """NIXL's bindings module, except that agents get a progress-thread poll timeout."""

    def __init__(self, bindings: types.ModuleType, poll_us: int):
        super().__init__(bindings.__name__)
        self._bindings = bindings
        self._poll_us = poll_us

    def __getattr__(self, name: str):
        return getattr(self._bindings, name)

    def nixlAgent(self, name, agent_config):  # noqa: N802 - mirrors the binding's name
        agent_config.pthrDelay = self._poll_us
        return self._bindings.nixlAgent(name, agent_config)


def _set_progress_poll(poll_us: int) -> None:
    wrapper = base_worker.NixlWrapper
    if wrapper is None:
        return  # NIXL absent: vLLM reports that itself
    api = sys.modules[wrapper.__module__]
    if not isinstance(api.nixlBind, _BindingsWithPollDelay):
        api.nixlBind = _BindingsWithPollDelay(api.nixlBind, poll_us)


def confine_threads(cores: set[int]) -> list[int]:
    """Put every thread of this process whose affinity reaches outside `cores` back
    onto `cores`; threads already inside (e.g. OpenMP threads bound to one of
    them) keep their narrower set. Returns the thread ids it moved."""
    moved = []
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        try:
            if not os.sched_getaffinity(tid) <= cores:
                os.sched_setaffinity(tid, cores)
                moved.append(tid)
        except (ProcessLookupError, PermissionError):
            pass  # the thread ended meanwhile
    return moved


def limit_idle_spin(seconds: float) -> None:
    """Make this process's shared-memory queue readers (the engine's step queue and its
    reply queue) busy-wait `seconds` after their last message instead of vLLM's 1 s.

    vLLM's CPU backend runs the model in a separate worker process fed through
    such queues unless VLLM_ENABLE_V1_MULTIPROCESSING=0 (pdserve's workers set
    it when the engine has one tensor-parallel rank: then there are no such
    queues); after each step the reader spins (sched_yield) for a second before
    it sleeps on a socket. A prefill engine that runs a prompt a
    second therefore keeps its core busy all the time, and the edge, the
    router and the decode worker's gRPC front end queue behind it. Spinning
    only a few milliseconds keeps back-to-back decode steps as fast (the
    next step comes within that) and frees the core when there is no work.
    """
    import gc

    from vllm.distributed.device_communicators import shm_broadcast

    base = getattr(shm_broadcast.SpinCondition, "pdserve_original", shm_broadcast.SpinCondition)
    if shm_broadcast.SpinCondition is base:
        class _ShortSpin(base):
            pdserve_original = base
            pdserve_spin_s = seconds

            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                if self.is_reader:
                    self.busy_loop_s = self.pdserve_spin_s

        # Queues created from now on (the worker process builds its queues
        # after the connector) get the short spin ...
        shm_broadcast.SpinCondition = _ShortSpin
    # ... and readers that exist already (the engine core's reply queue).
    for obj in gc.get_objects():
        if isinstance(obj, base) and obj.is_reader:
            obj.busy_loop_s = seconds


class _Tuned:
    """What pdserve adds to a vLLM NIXL connector (mixed in before vLLM's class): keeps
    its worker's cores, lets NIXL's progress thread sleep in poll() when idle, stops
    the engine's idle spin early, and keeps a prefill engine's leases."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        poll_us = vllm_config.kv_transfer_config.kv_connector_extra_config.get(
            "progress_poll_us", 0)
        # NOTE: the worker creates its NIXL agent inside super().__init__.
        if poll_us > 0:
            _set_progress_poll(int(poll_us))
        spin_ms = vllm_config.kv_transfer_config.kv_connector_extra_config.get(
            "idle_spin_ms")
        if spin_ms is not None:
            limit_idle_spin(float(spin_ms) / 1000)
        cores = os.sched_getaffinity(0)
        super().__init__(vllm_config, role, kv_cache_config)
        # NOTE: threads started inside super().__init__ (NIXL's progress thread, the
        # push writer) inherited vLLM's re-pinned set too; confine_threads covers all.
        confine_threads(cores)
        # The producer's worker side keeps the leases (see transfer/leases.py).
        self.leases = (Leases(self.connector_worker)
                       if self.connector_worker is not None
                       and vllm_config.kv_transfer_config.kv_role == "kv_producer" else None)

    def get_transfer_results(self, finished_req_ids):
        results = super().get_transfer_results(finished_req_ids)
        if self.leases is not None:
            self.leases.step(results.finished_sending)
        return results


class NixlConnector(_Tuned, _VllmNixlConnector):
    """vLLM's pull connector (the decode engine READs the prefill's blocks), tuned;
    its decode side loads at most the prompt tokens the prefill computed."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        """Called by the decode engine's scheduler for a waiting request: how many of
        its tokens past `num_computed_tokens` the pull brings. Capped at the prefill's
        `remote_num_tokens`: a prompt that goes on past what the prefill computed
        (its sampled token appended) has the rest computed here."""
        count, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        params = request.kv_transfer_params
        if count and params and pulls_blocks(params):
            remote = computed_tokens(params)
            if remote is not None and num_computed_tokens + count > remote:
                count = remote - num_computed_tokens
                if count <= 0:
                    # NOTE: the local prefix cache holds all the prefill computed; the
                    # connector still frees the prefill's blocks (a full local hit).
                    return 0, False
        return count, load_async


class NixlPushConnector(_Tuned, _VllmNixlPushConnector):
    """vLLM's push connector (the prefill engine WRITEs into the decode engine's
    blocks once the decode engine registers them), tuned."""
