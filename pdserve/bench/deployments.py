"""The serving setups `pdserve bench compare` measures, each started and stopped here.

All run on this machine with the same model and the same compute units (CPU
cores, or GPUs with `--device cuda`):
- `PdserveStack`: `pdserve up` (1 prefill + 1 decode worker, each on half the
  units) with a prefill policy given by `--local-prefill-below`.
- `StockVllm`: stock vLLM OpenAI servers (`vllm.entrypoints.openai.api_server`),
  one per entry of `unit_sets`, each pinned to its cores or given its GPUs
  (tensor parallel across them).
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.launch import Group

_READY_TIMEOUT_S = int(os.environ.get("PDSERVE_BENCH_READY_S", "400"))


_ISSUED: set[int] = set()


def _below_ephemeral() -> range:
    """Ports the kernel never hands out for a bind to port 0: servers that vLLM and NIXL
    start on random ports cannot take one of ours between our probe and our bind."""
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(10000, max(10001, low - 1))


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes have spent so far (gone ones: none)."""
    import psutil
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def gateway_pids(up_pid: int) -> list[int]:
    """The edge and router processes of a `pdserve up` (what sits between clients and
    workers)."""
    import psutil
    return [c.pid for c in psutil.Process(up_pid).children()
            if {"edge", "router"} & set(c.cmdline())]


def worker_pids(up_pid: int) -> dict[str, list[int]]:
    """The worker processes of a `pdserve up`, by part: `prefill_worker` and
    `decode_worker` (the servicer's process) and `prefill_engine` and `decode_engine`
    (their engine's processes)."""
    import psutil
    out: dict[str, list[int]] = {f"{role}_{part}": [] for role in ("prefill", "decode")
                                 for part in ("worker", "engine")}
    for c in psutil.Process(up_pid).children():
        # A worker by its --worker-id (`up` names them prefill-0, decode-0, ...): the
        # edge's command line holds "prefill" too (--first-token prefill).
        args = c.cmdline()
        if "--worker-id" not in args[:-1]:
            continue
        role = args[args.index("--worker-id") + 1].split("-")[0]
        if role in ("prefill", "decode"):
            out[f"{role}_worker"].append(c.pid)
            out[f"{role}_engine"] += [g.pid for g in c.children(recursive=True)]
    return out


def free_port(avoid: tuple[range, ...] = ()) -> int:
    """A TCP port free on loopback right now, below the ephemeral range, in none of
    `avoid` (ranges other servers listen in later, e.g. UCX's `UCX_TCP_PORT_RANGE`), and
    not handed out before by this process."""
    import random
    import socket
    ports = _below_ephemeral()
    while True:
        port = random.randrange(ports.start, ports.stop)
        if port in _ISSUED or any(port in r for r in avoid):
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _ISSUED.add(port)
        return port


def free_port_run(n: int) -> int:
    """A port p with p .. p+n-1 all free (NIXL side channels of n workers)."""
    import socket
    for _ in range(50):
        p = free_port()
        try:
            for q in range(p + 1, p + n):
                if q in _ISSUED:
                    raise OSError(q)
                with socket.socket() as s:
                    s.bind(("127.0.0.1", q))
        except OSError:
            continue
        _ISSUED.update(range(p, p + n))
        return p
    raise RuntimeError(f"no run of {n} free ports")


def metric_sum(url: str, name: str, labels: str = "") -> float:
    """Sum of the Prometheus samples of `name` at `url` whose labels contain `labels`."""
    return samples_sum(metrics_page(url), name, labels)


def metrics_page(url: str) -> str:
    import urllib.request
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def samples_sum(page: str, name: str, labels: str = "") -> float:
    """Sum of the samples of `name` in a Prometheus text `page` whose labels contain
    `labels`."""
    import re
    values = re.findall(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", page, re.M)
    return sum(float(v) for found, v in values if labels in found)


def _spec(units: list[int]) -> str:
    return ",".join(map(str, units))


@dataclass(frozen=True, slots=True)
class Hardware:
    """What every deployment of one comparison runs on."""

    device: str = "cpu"           # "cpu" | "cuda"
    units: tuple[int, ...] = ()   # core ids (cpu) or GPU ids (cuda)
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if not self.units:
            raise ValueError("units must name at least one core or GPU")

    def halves(self) -> tuple[list[int], list[int]]:
        """Lower and upper half of the units (one unit: both get it)."""
        units = list(self.units)
        half = max(1, len(units) // 2)
        return units[:half], units[half:] or units[:half]


def processes(label: str) -> Group:
    """A deployment's processes, each given the bench's wait to be ready."""
    return Group(label, ready_s=_READY_TIMEOUT_S)


class PdserveStack:
    """`pdserve up` on free loopback ports."""

    def __init__(self, label: str, model: str, local_prefill_below: int, hw: Hardware,
                 decode_workers: int = 1, placement: tuple[str, ...] = (),
                 prefill_workers: int = 1):
        self.label = label
        self.model = model
        self.local_prefill_below = local_prefill_below
        self.hw = hw
        self.prefill_workers = prefill_workers
        self.decode_workers = decode_workers
        self.placement = placement      # more of up's flags (e.g. the router's --balance 2)
        self.children = processes(label)
        self.urls: list[str] = []
        self.ports: dict[str, int] = {}

    def start(self) -> list[str]:
        n = self.prefill_workers + self.decode_workers
        self.ports = {k: free_port() for k in ("edge", "grpc", "router")}
        self.ports |= {"prefill": free_port_run(self.prefill_workers),
                       "decode": free_port_run(self.decode_workers),
                       "metrics": free_port_run(n)}
        kv = free_port_run(n)          # NIXL side channels of the workers
        cmd = [sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", "up",
               "--model", self.model, "--port", str(self.ports["edge"]),
               "--grpc-port", str(self.ports["grpc"]), "--router-port", str(self.ports["router"]),
               "--prefill-port", str(self.ports["prefill"]),
               "--decode-port", str(self.ports["decode"]), "--kv-port", str(kv),
               "--local-prefill-below", str(self.local_prefill_below),
               "--prefill-workers", str(self.prefill_workers),
               "--decode-workers", str(self.decode_workers),
               "--worker-metrics-port", str(self.ports["metrics"]), *self.placement,
               "--max-model-len", str(self.hw.max_model_len)]
        pre, dec = self.hw.halves()
        if self.hw.device == "cuda":
            cmd += ["--device", "cuda", "--prefill-gpus", _spec(pre), "--decode-gpus", _spec(dec)]
        else:
            cmd += ["--prefill-cpus", _spec(pre), "--decode-cpus", _spec(dec)]
        self.children.start(cmd, {})
        self.urls = [f"http://127.0.0.1:{self.ports['edge']}"]
        self.children.wait_healthy([u + "/health" for u in self.urls])
        return self.urls

    def worker_addresses(self, role: str) -> list[str]:
        """gRPC addresses of every prefill or every decode worker."""
        count = self.prefill_workers if role == "prefill" else self.decode_workers
        return [f"127.0.0.1:{self.ports[role] + i}" for i in range(count)]

    @property
    def prefill_metrics(self) -> str:
        """The (first) prefill engine's vllm:* (and lease) metrics URL."""
        return f"http://127.0.0.1:{self.ports['metrics']}/metrics"

    @property
    def decode_metrics(self) -> list[str]:
        """The decode engines' vllm:* metrics URLs (the prefill workers' come first)."""
        return [f"http://127.0.0.1:{self.ports['metrics'] + self.prefill_workers + i}/metrics"
                for i in range(self.decode_workers)]

    @property
    def up_pid(self) -> int:
        """The `pdserve up` process (its children are the stack's services)."""
        return self.children.children[0].pid

    def gateway_pids(self) -> list[int]:
        return gateway_pids(self.up_pid)

    def worker_pids(self) -> dict[str, list[int]]:
        return worker_pids(self.up_pid)

    def worker_metrics(self) -> dict[str, str]:
        """The /metrics URL of the first prefill and the first decode worker (`up`
        numbers the workers' metrics ports from the first, prefill workers first)."""
        base = self.ports["metrics"]
        return {"prefill": f"http://127.0.0.1:{base}/metrics",
                "decode": f"http://127.0.0.1:{base + self.prefill_workers}/metrics"}

    def stop(self) -> None:
        self.children.stop()


class StockVllm:
    """Stock vLLM OpenAI servers, one per unit set, with the engine settings pdserve's
    workers use (CPU: fp32, eager, 1 GiB of KV per engine, the model in the engine
    core's process; GPU: bf16, tensor parallel over the set) and vLLM's own defaults
    otherwise (prefix caching on)."""

    def __init__(self, label: str, model: str, unit_sets: list[list[int]], hw: Hardware):
        self.label = label
        self.model = model
        self.unit_sets = unit_sets
        self.hw = hw
        self.children = processes(label)
        self.urls: list[str] = []

    def start(self) -> list[str]:
        for units in self.unit_sets:
            port = free_port()
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                   "--model", self.model, "--max-model-len", str(self.hw.max_model_len),
                   "--host", "127.0.0.1", "--port", str(port), "--disable-log-stats"]
            env = {"VLLM_LOGGING_LEVEL": "WARNING"}
            if self.hw.device == "cuda":
                cmd += ["--dtype", "bfloat16", "--tensor-parallel-size", str(len(units))]
                env["CUDA_VISIBLE_DEVICES"] = _spec(units)
                self.children.start(cmd, env)
            else:
                cmd += ["--dtype", "float32", "--enforce-eager"]
                env |= {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": _spec(units),
                        # as pdserve/cli.py's _engine_env: the operator's choice, else 0
                        "VLLM_ENABLE_V1_MULTIPROCESSING":
                            os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")}
                self.children.start(cmd, env, cores=units)
            self.urls.append(f"http://127.0.0.1:{port}")
        self.children.wait_healthy([u + "/health" for u in self.urls])
        return self.urls

    def stop(self) -> None:
        self.children.stop()


class EmbeddedEdge:
    """A second pdserve edge with its router inside (`pdserve edge --router embedded`),
    in front of already-running workers, which it probes as static engines: so that
    the two ways of running pdserve's gateway are measured over the same workers."""

    def __init__(self, label: str, model: str, prefill: list[str], decode: list[str],
                 max_model_len: int, edge_flags: tuple[str, ...] = ()):
        self.label = label
        self.children = processes(label)
        self.args = [f"--prefill-worker={a}" for a in prefill] + [
            f"--decode-worker={a}" for a in decode] + [
            "--model", model, "--max-model-len", str(max_model_len),
            # Every prompt prefilled remotely, as the stack's router is told for comparisons.
            "--local-prefill-below", "0", "--prefill-saturated", "0",
            "--min-prefill-workers", str(len(prefill)), "--min-decode-workers", str(len(decode)),
            *edge_flags]

    def start(self) -> list[str]:
        port = free_port()
        self.children.start([sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING",
                             "edge", "--router", "embedded", "--router-port", str(free_port()),
                             "--port", str(port), "--grpc-port", str(free_port()), *self.args],
                            {})
        urls = [f"http://127.0.0.1:{port}"]
        self.children.wait_healthy([u + "/health" for u in urls])
        return urls

    def pids(self) -> list[int]:
        return self.children.pids()

    def stop(self) -> None:
        self.children.stop()


class SmgGateway:
    """The Shepherd Model Gateway (`smg launch --pd-disaggregation`) in front of
    already-running prefill and decode workers, over vLLM's engine protocol."""

    def __init__(self, label: str, model: str, prefill: list[str], decode: list[str],
                 policy: str = ""):
        self.label = label
        self.model = model
        self.prefill = prefill          # worker addresses, host:port
        self.decode = decode
        self.policy = policy
        self.children = processes(label)
        self.urls: list[str] = []

    def start(self) -> list[str]:
        exe = Path(sys.executable).with_name("smg")
        port = free_port()
        self.children.start(
            [str(exe) if exe.exists() else "smg", "launch", "--pd-disaggregation",
             *[arg for a in self.prefill for arg in ("--prefill", f"grpc://{a}")],
             *[arg for a in self.decode for arg in ("--decode", f"grpc://{a}")],
             *(["--policy", self.policy] if self.policy else []),
             "--host", "127.0.0.1", "--port", str(port), "--model-path", self.model,
             # its metrics server binds 0.0.0.0:29000 unless told otherwise
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
             "--log-level", "warn"], {})
        self.urls = [f"http://127.0.0.1:{port}"]
        self.children.wait_healthy([u + "/v1/models" for u in self.urls])
        self._wait_for_model()
        return self.urls

    def _wait_for_model(self) -> None:
        """SMG answers /v1/models before it has found its workers' model."""
        import json
        import urllib.request
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline:
            with urllib.request.urlopen(self.urls[0] + "/v1/models", timeout=2) as r:
                if json.loads(r.read())["data"]:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"{self.label}: no model listed in {_READY_TIMEOUT_S}s")

    def pids(self) -> list[int]:
        """The gateway's processes."""
        return self.children.pids()

    def stop(self) -> None:
        self.children.stop()
