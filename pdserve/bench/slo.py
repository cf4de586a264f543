"""Service-level objectives and goodput: the requests per second that met their SLO.

A request meets an SLO when its time to first token is within `ttft_ms` and no
gap between two of its streamed tokens exceeds `itl_ms` (the stall a reader of
the stream sees; vLLM's TPOT goodput averages stalls away). Failed requests
never count. The defaults fit the tiny model on this CPU class of machine;
`--slo name=ttft:MS,itl:MS` sets them for a real model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # the planner reads the mixes without importing vLLM
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput


@dataclass(frozen=True, slots=True)
class SLO:
    """Per-request limits, in milliseconds."""

    ttft_ms: float
    itl_ms: float

    def __post_init__(self) -> None:
        if self.ttft_ms <= 0 or self.itl_ms <= 0:
            raise ValueError(f"SLO limits must be > 0 ms, got ttft {self.ttft_ms}, "
                             f"itl {self.itl_ms}")

    def met_by(self, out: RequestFuncOutput) -> bool:
        """True when `out` succeeded within both limits."""
        return (out.success and out.ttft * 1000 <= self.ttft_ms
                and max(out.itl, default=0.0) * 1000 <= self.itl_ms)


# ITL-strict: a streaming reader that must never stall; TTFT-strict: an
# interactive turn that must start at once; balanced: both, moderately.
DEFAULT_MIXES = {
    "itl_strict": SLO(ttft_ms=3000, itl_ms=40),
    "ttft_strict": SLO(ttft_ms=250, itl_ms=500),
    "balanced": SLO(ttft_ms=750, itl_ms=100),
}


def parse_slo(spec: str) -> tuple[str, SLO]:
    """'itl_strict=ttft:3000,itl:40' -> ('itl_strict', SLO(3000, 40))."""
    name, sep, limits = spec.partition("=")
    try:
        values = dict(part.split(":") for part in limits.split(","))
        slo = SLO(ttft_ms=float(values["ttft"]), itl_ms=float(values["itl"]))
    except (ValueError, KeyError) as e:
        raise ValueError(f"--slo must look like NAME=ttft:MS,itl:MS, got {spec!r}") from e
    if not sep or name not in DEFAULT_MIXES:
        raise ValueError(f"--slo name must be one of {sorted(DEFAULT_MIXES)}, got {name!r}")
    return name, slo


def goodput(outputs: list[RequestFuncOutput], duration_s: float, slo: SLO) -> float:
    """Requests per second that met `slo`."""
    return sum(slo.met_by(o) for o in outputs) / duration_s if duration_s > 0 else 0.0
