"""Config validation names the field; the CLI turns a bad flag into exit code 2."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdserve.config import EdgeConfig, EngineConfig, KVTransferConfig, RouterConfig, WorkerConfig


@pytest.mark.parametrize("make,field", [
    (lambda: EngineConfig(model=""), "model"),
    (lambda: EngineConfig(model="m", device="tpu"), "device"),
    (lambda: EngineConfig(model="m", dtype="int3"), "dtype"),
    (lambda: EngineConfig(model="m", max_model_len=0), "max_model_len"),
    (lambda: EngineConfig(model="m", gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (lambda: EngineConfig(model="m", block_size=0), "block_size"),
    (lambda: EngineConfig(model="m", max_num_batched_tokens=32), "max_num_batched_tokens"),
    (lambda: EngineConfig(model="m", max_num_batched_tokens=1024, enable_chunked_prefill=False),
     "max_num_batched_tokens"),
    (lambda: KVTransferConfig(side_channel_port=70000), "side_channel_port"),
    (lambda: KVTransferConfig(connector="carrier-pigeon"), "connector"),
    (lambda: KVTransferConfig(mode="teleport"), "mode"),
    (lambda: WorkerConfig(role="cook", engine=EngineConfig(model="m")), "role"),
    (lambda: WorkerConfig(role="decode", engine=EngineConfig(model="m"), metrics_port=70000),
     "metrics_port"),
    (lambda: RouterConfig(local_prefill_below_tokens=-1), "local_prefill_below_tokens"),
    (lambda: EdgeConfig(model="m", port=-1), "port"),
    (lambda: EdgeConfig(model="m", min_decode_workers=0), "min_decode_workers"),
    (lambda: EdgeConfig(model="m", first_token="router"), "first_token"),
    (lambda: EdgeConfig(model="m", decode_window_bytes=-1), "decode_window_bytes"),
])
def test_invalid_config_names_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_defaults_are_cpu_and_loopback():
    engine = EngineConfig(model="m")
    assert (engine.device, engine.dtype, engine.name) == ("cpu", "float32", "m")
    assert EdgeConfig(model="m").host == RouterConfig().host == "127.0.0.1"
    assert EdgeConfig(model="m").port == 8000


# What an engine knob is when not given: eager and vLLM's CPU block and batch on CPU;
# CUDA graphs, vLLM's GPU block and an H100's batch on CUDA.
BY_DEVICE = {
    "cpu": {"dtype": "float32", "enforce_eager": True, "block_size": 128,
            "max_num_batched_tokens": 2048, "enable_chunked_prefill": True},
    "cuda": {"dtype": "bfloat16", "enforce_eager": False, "block_size": 16,
             "max_num_batched_tokens": 8192, "enable_chunked_prefill": True},
}


def _knobs(cfg: EngineConfig) -> dict:
    return {name: getattr(cfg, name) for name in BY_DEVICE["cpu"]}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_an_engines_knobs_default_by_its_device(device):
    from pdserve.cli import _config, _parser
    assert _knobs(EngineConfig(model="m", device=device)) == BY_DEVICE[device]
    # The CLI leaves them to the config: the same for a worker and for `up`.
    for argv in (["decode", "--device", device], ["up", "--device", device]):
        cfg = _config(_parser().parse_args(argv))
        assert _knobs(getattr(cfg, "engine", cfg)) == BY_DEVICE[device]


def test_cuda_runs_cuda_graphs_and_cpu_stays_eager():
    from pdserve.cli import _config, _parser
    assert _config(_parser().parse_args(["prefill", "--device", "cuda"])).engine.enforce_eager \
        is False
    assert _config(_parser().parse_args(["prefill"])).engine.enforce_eager is True


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_engine_flags_override_the_device_defaults(device):
    from pdserve.cli import _config, _parser
    given = {"dtype": "float16", "enforce_eager": device == "cuda", "block_size": 32,
             "max_num_batched_tokens": 4096, "enable_chunked_prefill": False}
    cfg = _config(_parser().parse_args([
        "decode", "--device", device, "--dtype", "float16",
        "--enforce-eager" if device == "cuda" else "--no-enforce-eager", "--block-size", "32",
        "--max-num-batched-tokens", "4096", "--no-enable-chunked-prefill"]))
    assert _knobs(cfg.engine) == given


def test_without_chunked_prefill_a_step_holds_the_longest_prompt_by_default():
    """As vLLM does when not told: an unchunked prompt must fit one step."""
    cfg = EngineConfig(model="m", max_model_len=4096, enable_chunked_prefill=False)
    assert cfg.max_num_batched_tokens == 4096
    assert EngineConfig(model="m", device="cuda", max_model_len=4096,
                        enable_chunked_prefill=False).max_num_batched_tokens == 8192


def test_engine_help_names_each_devices_default():
    from pdserve.cli import _parser
    sub = _parser()._subparsers._group_actions[0].choices["up"]
    helps = {a.dest: a.help for a in sub._actions}
    assert "eager on cpu, CUDA graphs on cuda" in helps["enforce_eager"]
    assert "128 on cpu, 16 on cuda" in helps["block_size"]
    assert "2048 on cpu, 8192 on cuda" in helps["max_num_batched_tokens"]
    assert "float32 on cpu, bfloat16 on cuda" in helps["dtype"]


def test_cli_rejects_bad_flag_with_exit_2():
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "router", "--port", "99999"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "port" in out.stderr and "Traceback" not in out.stderr


def test_a_worker_binds_its_nixl_side_channel_to_the_address_it_advertises():
    from pdserve.cli import _config, _parser
    cfg = _config(_parser().parse_args(["prefill", "--host", "0.0.0.0", "--advertise-host",
                                        "10.0.0.7", "--kv-lease-seconds", "4"]))
    assert (cfg.kv.side_channel_host, cfg.kv.lease_seconds) == ("10.0.0.7", 4)
    cfg = _config(_parser().parse_args(["decode"]))
    assert cfg.kv.side_channel_host == "127.0.0.1" and cfg.kv.lease_seconds == 6


def test_the_transfer_mode_picks_vllms_connector_by_name_from_pdserves_module():
    from pdserve.cli import _config, _parser
    from pdserve.transfer.connector import engine_kv_config
    for mode, name in (("pull", "NixlConnector"), ("push", "NixlPushConnector")):
        cfg = _config(_parser().parse_args(["decode", "--kv-transfer-mode", mode]))
        kv = engine_kv_config("decode", cfg.kv)
        assert (kv["kv_connector"], kv["kv_connector_module_path"]) == (name,
                                                                          "pdserve.transfer.vllm_nixl")
    assert _config(_parser().parse_args(["prefill"])).kv.mode == "pull"


def test_only_a_pull_decode_worker_goes_on_after_the_prefills_token():
    """What a worker announces (registration and gRPC health): the pull connector's
    decode side caps its load at what the prefill computed; the push connector writes
    into blocks sized for the prompt alone, and a prefill worker decodes nothing."""
    from pdserve.cli import _config, _parser
    from pdserve.transfer.connector import continues_prefill
    got = {(role, mode): continues_prefill(role, _config(_parser().parse_args(
        [role, "--kv-transfer-mode", mode])).kv)
        for role in ("prefill", "decode") for mode in ("pull", "push")}
    assert got == {("prefill", "pull"): False, ("prefill", "push"): False,
                   ("decode", "pull"): True, ("decode", "push"): False}


def test_the_edge_sends_the_prefills_token_first_unless_told_not_to():
    from pdserve.cli import _config, _parser
    assert _config(_parser().parse_args(["edge"])).first_token == "prefill"
    assert _config(_parser().parse_args(["edge", "--first-token", "decode"])).first_token == \
        "decode"


@pytest.mark.parametrize("device,tp,given,expected", [
    ("cpu", 1, None, "0"),       # the engine core runs the model: no third process
    ("cpu", 1, "1", "1"),        # an operator's choice is kept
    ("cpu", 2, None, None),      # tensor parallelism needs vLLM's worker processes
    ("cuda", 1, None, None),     # GPUs: vLLM's own default
])
def test_a_worker_runs_the_model_in_the_engine_core_on_one_cpu_rank(monkeypatch, device, tp,
                                                                     given, expected):
    from pdserve.cli import _engine_env
    monkeypatch.setattr(os, "environ", dict(os.environ))     # _engine_env writes the environ
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if given is not None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = given
    engine = EngineConfig(model="m", device=device, tensor_parallel_size=tp)
    _engine_env(WorkerConfig(role="decode", engine=engine), cpus="")
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == expected


@pytest.mark.parametrize("setter,name,given,expected", [
    # A gateway process reads gRPC's sockets on its poller thread...
    ("_gateway_grpc_env", "GRPC_EXPERIMENTS", None, "-event_engine_client,-event_engine_listener"),
    ("_gateway_grpc_env", "GRPC_EXPERIMENTS", "", ""),     # an operator's choice is kept
    ("_gateway_grpc_env", "GRPC_EXPERIMENTS", "-event_engine_dns", "-event_engine_dns"),
    # ...and every pdserve process keeps gRPC's C core quiet below an error, unless told.
    ("_grpc_log_env", "GRPC_VERBOSITY", None, "ERROR"),
    ("_grpc_log_env", "GRPC_VERBOSITY", "DEBUG", "DEBUG"),
])
def test_grpc_environment_defaults_keep_an_operators_own(monkeypatch, setter, name, given,
                                                         expected):
    from pdserve import cli
    monkeypatch.setattr(os, "environ", dict(os.environ))
    os.environ.pop(name, None)
    if given is not None:
        os.environ[name] = given
    getattr(cli, setter)()
    assert os.environ[name] == expected


@pytest.mark.parametrize("argv", [["edge", "--router", "embedded"], ["router"]])
def test_grpc_is_not_imported_before_a_gateway_sets_its_experiments(argv):
    """gRPC reads GRPC_EXPERIMENTS once: the CLI must get as far as the command's
    configuration without importing it, or the edge's setting would not apply."""
    code = ("import sys, pdserve.cli as c\n"
            f"a = c._parser().parse_args({argv!r})\n"
            "c.telemetry.configure_logging(a.command, a.log_level, a.log_format)\n"
            "c._config(a)\n"
            "print(sorted(m for m in sys.modules if m == 'grpc' or m.startswith('grpc.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_a_worker_refuses_a_side_channel_port_another_process_listens_on():
    """vLLM's handshake listener dies on a taken port and the engine's start then
    hangs; the worker checks first and names the port."""
    import socket
    from support import free_port
    from pdserve.transfer.connector import check_side_channel
    port = free_port()
    check_side_channel(KVTransferConfig(side_channel_port=port))      # free: no error
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        with pytest.raises(RuntimeError, match=f"127.0.0.1:{port} is in use"):
            check_side_channel(KVTransferConfig(side_channel_port=port))


def test_an_ipv6_side_channel_port_is_checked_on_ipv6():
    import socket
    from support import free_port, ipv6_loopback
    from pdserve.transfer.connector import check_side_channel
    if not ipv6_loopback():
        pytest.skip("no IPv6 loopback (::1) on this machine")
    port = free_port()
    kv = KVTransferConfig(side_channel_host="::1", side_channel_port=port)
    check_side_channel(kv)
    with socket.socket(socket.AF_INET6) as held:
        held.bind(("::1", port))
        held.listen()
        with pytest.raises(RuntimeError, match=rf"\[::1\]:{port} is in use"):
            check_side_channel(kv)


def test_an_ipv6_worker_advertises_brackets_and_binds_bare():
    from pdserve.cli import _config, _parser
    cfg = _config(_parser().parse_args(["decode", "--host", "::", "--advertise-host",
                                        "[fd00::7]", "--router", "[fd00::1]:50051"]))
    assert (cfg.host, cfg.advertise_host, cfg.router) == ("::", "fd00::7", "[fd00::1]:50051")
    # vLLM's NIXL connector takes the side channel's host bare and brackets it itself.
    assert cfg.kv.side_channel_host == "fd00::7"
    assert RouterConfig(static_workers=(("decode", "[::1]:50071"),)).static_workers
    with pytest.raises(ValueError, match=r"\[IPV6\]:PORT"):
        RouterConfig(static_workers=(("decode", "::1:50071"),))


def test_an_ipv6_side_channel_moves_the_blocks_over_ipv6_too():
    from pdserve.transfer.connector import engine_kv_env
    v6 = engine_kv_env(KVTransferConfig(side_channel_host="::1"))
    assert (v6["VLLM_NIXL_SIDE_CHANNEL_HOST"], v6["UCX_TCP_AF_PRIO"]) == ("::1", "inet6,inet")
    assert engine_kv_env(KVTransferConfig())["UCX_TCP_AF_PRIO"] == "inet,inet6"   # UCX's own
