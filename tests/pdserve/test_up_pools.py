"""`pdserve up --prefill-workers N --decode-workers M`: ports, cores and ids per worker."""
from __future__ import annotations

import pytest

from pdserve.cli import _config, _parser
from pdserve.supervisor import _commands, _spread


def _plan(*flags: str) -> dict[str, list[str]]:
    a = _parser().parse_args(["up", "--prefill-cpus", "0", "--decode-cpus", "1,2,3", *flags])
    return {name: cmd for name, cmd, _ in _commands(a, _config(a))}


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_pools_get_their_own_ports_ids_and_cores():
    plan = _plan("--prefill-workers", "2", "--decode-workers", "3", "--worker-metrics-port", "9000")
    assert list(plan) == ["router", "prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2",
                          "edge"]
    workers = [plan[n] for n in list(plan)[1:-1]]
    assert [_flag(c, "--port") for c in workers] == ["50061", "50062", "50071", "50072", "50073"]
    assert [_flag(c, "--kv-port") for c in workers] == ["5600", "5601", "5602", "5603", "5604"]
    assert [_flag(c, "--metrics-port") for c in workers] == ["9000", "9001", "9002", "9003",
                                                             "9004"]
    assert [_flag(c, "--worker-id") for c in workers] == [
        "prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2"]
    # Two prefill engines share the one prefill core; decode gets a core each.
    assert [_flag(c, "--cpus") for c in workers] == ["0", "0", "1", "2", "3"]
    assert _flag(plan["edge"], "--min-decode-workers") == "3"
    assert _flag(plan["router"], "--balance") == "1.25"          # placement flags pass through
    # A worker's drain is the edge's: `up` stops the edge first, then the workers.
    assert {_flag(c, "--drain-seconds") for c in workers} == {
        _flag(plan["edge"], "--drain-seconds")}


def test_gateway_runs_anywhere_unless_told():
    plan = _plan("--prefill-workers", "2")
    assert "--cpus" not in plan["edge"] and "--cpus" not in plan["router"]
    plan = _plan("--gateway-cpus", "2-3")
    assert _flag(plan["edge"], "--cpus") == _flag(plan["router"], "--cpus") == "2-3"


def test_spread_gives_equal_shares_or_shares_units():
    assert _spread(["0", "1", "2", "3"], 2) == ["0,1", "2,3"]
    assert _spread(["4"], 3) == ["4", "4", "4"]


@pytest.mark.parametrize("flags", [["--decode-workers", "0"],
                                   ["--prefill-workers", "12"]])
def test_bad_pool_sizes_are_refused(flags):
    a = _parser().parse_args(["up", *flags])
    with pytest.raises(ValueError):
        _config(a)


def test_edge_flags_pass_through_and_parse_back():
    plan = _plan("--no-admission", "--stream-store", "redis://127.0.0.1:6379",
                 "--api-keys-file", "/run/keys", "--tenant-salt-file", "/run/salt",
                 "--decode-window-bytes", "0")
    edge = plan["edge"]
    assert "--no-admission" in edge and _flag(edge, "--stream-store") == "redis://127.0.0.1:6379"
    assert _flag(edge, "--api-keys-file") == "/run/keys"
    cfg = _config(_parser().parse_args(edge[edge.index("edge"):]))
    assert (cfg.admission, cfg.stream_store, cfg.api_keys_file, cfg.tenant_salt_file,
            cfg.decode_window_bytes) == (False, "redis://127.0.0.1:6379", "/run/keys",
                                         "/run/salt", 0)
    assert "--admission" in _plan()["edge"]
    assert _config(_parser().parse_args(_plan()["edge"][_plan()["edge"].index("edge"):])
                   ).decode_window_bytes == 8192


def test_router_in_edge_starts_no_router_and_the_edge_serves_its_port():
    plan = _plan("--router-in-edge", "--decode-workers", "2", "--balance", "1.5",
                 "--router-port", "50999")
    assert list(plan) == ["prefill-0", "decode-0", "decode-1", "edge"]
    assert {_flag(plan[n], "--router") for n in ("prefill-0", "decode-0", "decode-1")} == {
        "127.0.0.1:50999"}
    edge = plan["edge"]
    cfg = _config(_parser().parse_args(edge[edge.index("edge"):]))
    assert cfg.router == "embedded"
    # The placement flags reach the router the edge runs, on the router's own port.
    r = cfg.embedded_router
    assert (r.balance, r.host, r.port) == (1.5, "127.0.0.1", 50999)
    assert _config(_parser().parse_args(["edge"])).embedded_router is None


def test_static_engines_on_an_edge_need_its_own_router():
    with pytest.raises(ValueError, match="--router embedded"):
        _config(_parser().parse_args(["edge", "--decode-worker", "127.0.0.1:1"]))
    cfg = _config(_parser().parse_args(["edge", "--router", "embedded",
                                        "--decode-worker", "127.0.0.1:1"]))
    assert cfg.embedded_router.static_workers == (("decode", "127.0.0.1:1"),)


def _engine_knobs(cmd: list[str]):
    """A worker's command line, parsed back: its engine's by-device knobs."""
    role = next(i for i, arg in enumerate(cmd) if arg in ("prefill", "decode"))
    e = _config(_parser().parse_args(cmd[role:])).engine
    return (e.device, e.dtype, e.enforce_eager, e.block_size, e.max_num_batched_tokens,
            e.enable_chunked_prefill)


@pytest.mark.parametrize("device,expected", [
    ("cpu", ("cpu", "float32", True, 128, 2048, True)),
    ("cuda", ("cuda", "bfloat16", False, 16, 8192, True)),
])
def test_every_worker_gets_the_engine_knobs_of_ups_device(device, expected):
    plan = _plan("--device", device, "--decode-workers", "2")
    workers = [plan[n] for n in ("prefill-0", "decode-0", "decode-1")]
    assert {_engine_knobs(c) for c in workers} == {expected}
    eager = "--enforce-eager" if expected[2] else "--no-enforce-eager"
    assert all(eager in c for c in workers)


def test_ups_engine_flags_reach_every_worker():
    plan = _plan("--device", "cuda", "--enforce-eager", "--block-size", "32",
                 "--max-num-batched-tokens", "4096", "--no-enable-chunked-prefill",
                 "--dtype", "float16")
    for name in ("prefill-0", "decode-0"):
        assert _engine_knobs(plan[name]) == ("cuda", "float16", True, 32, 4096, False)
    assert "--block-size" not in plan["edge"] and "--enforce-eager" not in plan["router"]


def _configs(plan: dict[str, list[str]]) -> dict:
    return {name: _config(_parser().parse_args(cmd[cmd.index("pdserve.cli") + 1:]))
            for name, cmd in plan.items()}


def test_an_ipv6_host_keeps_the_whole_stack_on_ipv6_loopback():
    cfgs = _configs(_plan("--host", "::1", "--router-port", "50999"))
    assert (cfgs["edge"].host, cfgs["edge"].router) == ("::1", "[::1]:50999")
    assert (cfgs["router"].host, cfgs["router"].port) == ("::1", 50999)
    for worker in (cfgs["prefill-0"], cfgs["decode-0"]):
        assert (worker.host, worker.router, worker.kv.side_channel_host) == (
            "::1", "[::1]:50999", "::1")
    edge = _configs(_plan("--host", "[::]", "--router-in-edge"))["edge"]
    assert (edge.host, edge.embedded_router.host) == ("::", "::1")


def test_only_the_edge_leaves_loopback():
    cfgs = _configs(_plan("--host", "0.0.0.0"))
    assert cfgs["edge"].host == "0.0.0.0"
    assert {cfgs[n].host for n in ("router", "prefill-0", "decode-0")} == {"127.0.0.1"}
    assert cfgs["decode-0"].router == cfgs["edge"].router == "127.0.0.1:50051"


@pytest.mark.parametrize("in_edge", [False, True])
def test_the_stack_shares_one_cluster_token_file(in_edge):
    a = _parser().parse_args(["up", "--prefill-cpus", "0", "--decode-cpus", "1"]
                             + (["--router-in-edge"] if in_edge else []))
    plan = {name: cmd for name, cmd, _ in _commands(a, _config(a), "/run/token")}
    # Whoever serves the Router service checks it; every worker shows it.
    checks = "edge" if in_edge else "router"
    for name in (checks, "prefill-0", "decode-0"):
        assert _flag(plan[name], "--cluster-token-file") == "/run/token", name
    for name, cmd in plan.items():
        assert _parser().parse_args(cmd[cmd.index("pdserve.cli") + 1:])   # flags it accepts


def test_up_with_keys_makes_its_edge_a_salt_secret(tmp_path):
    from pdserve.supervisor import _salt_secret
    a = _parser().parse_args(["up", "--api-keys-file", "/run/keys"])
    _salt_secret(a, str(tmp_path))
    secret = tmp_path / "tenant-salt"
    assert a.tenant_salt_file == str(secret) and len(secret.read_bytes()) >= 32
    assert secret.stat().st_mode & 0o777 == 0o600
    edge = _commands(a, _config(a), "/run/token")[-1][1]
    cfg = _config(_parser().parse_args(edge[edge.index("edge"):]))
    assert cfg.tenant_salt_file == str(secret)
    given = _parser().parse_args(["up", "--api-keys-file", "k", "--tenant-salt-file", "/s"])
    _salt_secret(given, str(tmp_path / "none"))
    assert given.tenant_salt_file == "/s"


def test_router_replicas_count_up_and_every_worker_and_the_edge_get_the_list():
    plan = _plan("--routers", "3", "--router-port", "50100", "--router-metrics-port", "9300")
    assert [n for n in plan if n.startswith("router")] == ["router-0", "router-1", "router-2"]
    cfgs = _configs(plan)
    assert [(cfgs[f"router-{i}"].port, cfgs[f"router-{i}"].metrics_port)
            for i in range(3)] == [(50100, 9300), (50101, 9301), (50102, 9302)]
    every = "127.0.0.1:50100,127.0.0.1:50101,127.0.0.1:50102"
    assert cfgs["edge"].router == cfgs["prefill-0"].router == cfgs["decode-0"].router == every
    # One replica keeps the name and flags it always had.
    assert _flag(_plan()["router"], "--port") == "50051"
    with pytest.raises(ValueError, match="--routers"):
        _plan("--routers", "2", "--router-in-edge")
    with pytest.raises(ValueError, match="router ports run into"):
        _plan("--routers", "12")                     # 50051..50062 meets prefill's 50061


def test_the_edge_metrics_port_reaches_the_edge():
    assert _configs(_plan("--edge-metrics-port", "9500"))["edge"].metrics_port == 9500
    assert _configs(_plan())["edge"].metrics_port == 0          # /metrics on --port
    with pytest.raises(ValueError, match="metrics_port"):
        _config(_parser().parse_args(["edge", "--metrics-port", "8000"]))
