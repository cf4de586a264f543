"""vLLM's NixlConnector, tuned for pdserve's deployments.

vLLM loads this class through `kv_connector_module_path` (see connector.py).
It keeps the name `NixlConnector` on purpose: vLLM's config checks look the
connector up by that name.

What differs: NIXL's Python agent hard-codes `pthrDelay = 0` for the UCX
progress thread, and the thread then calls poll() with a zero timeout, i.e.
it spins a whole core even when no transfer is in flight. On a 2-core CPU box
that is one core per engine, and everything else starves (measured here: a
0.35 s request took 9 s; idle workers at ~90% CPU each). With
`progress_poll_us` in the connector's extra config the thread blocks in
poll() on UCX's event fds for up to that long instead: it still wakes at once
for traffic, and idles at ~0% CPU. (Turning the thread off is not an option:
vLLM's handshake relies on it and the engine hangs.)
"""
from __future__ import annotations

import sys
import types

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlConnector as _VllmNixlConnector,
)


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


class NixlConnector(_VllmNixlConnector):
    """vLLM's NixlConnector whose NIXL progress thread sleeps in poll() when idle."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        poll_us = vllm_config.kv_transfer_config.kv_connector_extra_config.get(
            "progress_poll_us", 0)
        # NOTE: the worker creates its NIXL agent inside super().__init__.
        if poll_us > 0:
            _set_progress_poll(int(poll_us))
        super().__init__(vllm_config, role, kv_cache_config)
