"""`pdserve plan profile`'s pieces that need no engine: the sweep's points, the long-context
model, turning measured times into the profile's figures, and the command's errors."""
from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from support import ROOT
from pdserve.bench.plan import stack_sweep
from pdserve.bench.plan.cli import main
from pdserve.bench.plan.engine_sweep import Timer
from pdserve.bench.plan.grid import FRACTIONS, TOP_MARGIN, SweepSpec
from pdserve.bench.plan.profile import Profile
from pdserve.bench.plan.sweep import ProfileRun, transfer_lengths, with_context


def test_prefill_points_cover_every_fraction_up_to_the_longest_prompt():
    spec = SweepSpec(model="m", max_model_len=4096)
    points = spec.prefill_points()
    assert {f for _, f in points} == set(FRACTIONS)
    for fraction in FRACTIONS:
        lengths = [n for n, f in points if f == fraction]
        assert lengths == sorted(lengths) and lengths[-1] == 4096 - TOP_MARGIN
    assert len(SweepSpec(model="m", quick=True).prefill_points()) < len(
        SweepSpec(model="m").prefill_points())


@pytest.mark.parametrize("tokens,fraction", [(128, 0.5), (1024, 0.9), (2032, 0.9), (300, 0.5)])
def test_a_cached_prefix_is_whole_blocks_and_leaves_a_token_to_compute(tokens, fraction):
    spec = SweepSpec(model="m")
    cached = spec.cached_tokens(tokens, fraction)
    assert cached % spec.block_size() == 0
    assert cached <= fraction * tokens and cached < tokens
    assert fraction * tokens - cached < spec.block_size()     # the most whole blocks allow


def test_decode_points_fit_the_engines_kv_and_start_one_token_past_a_block():
    spec = SweepSpec(model="m", max_model_len=16384)
    kv = 100_000
    points = spec.decode_points(kv)
    assert {b for b, _ in points} >= {1, 64}
    for batch, context in points:
        assert context % spec.block_size() == 1
        assert batch == 1 or batch * (context + 16) <= 0.9 * kv
    assert max(c for _, c in points) > 8192          # long contexts are swept too


def test_a_spec_names_its_bad_field_and_travels_as_json():
    with pytest.raises(ValueError, match="device"):
        SweepSpec(model="m", device="tpu")
    with pytest.raises(ValueError, match="max_model_len"):
        SweepSpec(model="m", max_model_len=100)
    spec = SweepSpec(model="m", cpus="1", quick=True, max_model_len=8192)
    assert SweepSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec


def test_transfer_lengths_reach_the_longest_prompt():
    assert transfer_lengths(2048, quick=False) == (128, 512, 1024, 2048 - TOP_MARGIN)
    long = transfer_lengths(16384, quick=True)
    assert long[0] == 128 and long[-1] == 16384 - TOP_MARGIN and list(long) == sorted(long)


def _model_dir(path, positions: int):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": positions}))
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": positions}))
    (path / "model.safetensors").write_bytes(b"weights")
    return path


def test_a_longer_context_profiles_a_copy_with_the_same_weights(tmp_path):
    model = _model_dir(tmp_path / "tiny", 2048)
    assert with_context(str(model), 0, tmp_path) == str(model)
    assert with_context(str(model), 1024, tmp_path) == str(model)      # already allows it
    copy = with_context(str(model), 16384, tmp_path / "scratch")
    assert json.loads((tmp_path / "scratch" / "ctx16384" / "config.json").read_text())[
        "max_position_embeddings"] == 16384
    assert (tmp_path / "scratch" / "ctx16384" / "model.safetensors").read_bytes() == b"weights"
    assert copy != str(model)
    with pytest.raises(ValueError, match="config.json"):
        with_context(str(tmp_path / "nowhere"), 16384, tmp_path)


def test_overheads_are_what_the_stack_adds_to_the_engines():
    edge = [(30.0, 190.0), (34.0, 198.0)]           # (first, last) token ms, 33 tokens
    out = stack_sweep.overheads(edge, prefill_ms=20.0, decode_ms=150.0, route=1.0, output=33)
    assert out["edge_request_ms"] == pytest.approx(32.0 - 20.0 - 1.0)
    assert out["edge_token_ms"] == pytest.approx((162.0 - 150.0) / 32)
    assert out["router_request_ms"] == 1.0
    # Engines slower than the stack around them: noise, never a negative cost.
    fast = stack_sweep.overheads(edge, prefill_ms=40.0, decode_ms=170.0, route=1.0, output=33)
    assert fast["edge_request_ms"] == 0 and fast["edge_token_ms"] == 0


def _page(count: float, total: float) -> str:
    name = "vllm:e2e_request_latency_seconds"
    return (f'{name}_count{{model_name="m"}} {count}\n{name}_sum{{model_name="m"}} {total}\n')


def test_engine_time_is_the_mean_of_the_requests_between_two_reads():
    assert stack_sweep.engine_ms(_page(2, 0.5), _page(6, 0.9)) == pytest.approx(100.0)
    with pytest.raises(RuntimeError, match="no vllm:e2e_request_latency_seconds sample"):
        stack_sweep.engine_ms(_page(2, 0.5), _page(2, 0.5))


def test_transfer_points_read_the_connectors_own_time_per_length(monkeypatch):
    sent: list[int] = []
    xfer = stack_sweep.XFER_SECONDS

    def complete(url, model, ids):
        sent.append(len(ids))

    def series(url):                    # 2 ms a pull per 1,000 prompt tokens
        return {f"{xfer}_count": [("", float(len(sent)))],
                f"{xfer}_sum": [("", sum(n * 2e-6 for n in sent))]}

    monkeypatch.setattr(stack_sweep, "complete_disaggregated", complete)
    monkeypatch.setattr(stack_sweep, "nixl_series", series)
    spec = stack_sweep.StackSpec(transfer_tokens=(500, 2000), transfer_requests=3)
    points = stack_sweep.transfer_points("u", "m", "metrics", spec, random.Random(0),
                                         log=lambda _: None)
    assert [(p["tokens"], p["transfers"]) for p in points] == [(500, 3), (2000, 3)]
    assert [p["ms"] for p in points] == pytest.approx([1.0, 4.0])
    monkeypatch.setattr(stack_sweep, "nixl_series", lambda url: {})
    with pytest.raises(RuntimeError, match="no NIXL transfer"):
        stack_sweep.transfer_points("u", "m", "metrics", spec, random.Random(0), log=print)


def test_the_command_refuses_bad_arguments_with_a_clear_error(capsys):
    assert main(["profile", "--max-context", "100"]) == 2
    assert "--max-context must be in" in capsys.readouterr().err
    assert main(["profile", "--device", "cuda", "--gpus", "a,b"]) == 2
    assert "--gpus must be" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["profile", "--device", "tpu"])
    assert e.value.code == 2
    assert main(["nothing"]) == 2 and "pdserve plan profile" in capsys.readouterr().err
    with pytest.raises(ValueError, match="units"):
        ProfileRun(model="m", units=())


@pytest.mark.parametrize("name", ["plan_profile_cpu.json", "plan_profile_cpu_16k.json"])
def test_the_committed_profiles_load_and_hold_the_sweeps_grid(name):
    prof = Profile.load(ROOT / "bench" / "results" / name)
    top = prof.max_model_len - TOP_MARGIN
    assert {p["cached_fraction"] for p in prof.prefill} == set(FRACTIONS)
    assert max(p["tokens"] for p in prof.prefill) == top
    assert prof.prefill_ms(top) > prof.prefill_ms(128) > 0
    assert prof.prefill_ms(top, 0.9) < prof.prefill_ms(top)   # a cached prefix is cheaper
    assert {p["batch"] for p in prof.decode} >= {1, prof.max_num_seqs}
    assert all(p["ms"] > 0 for p in prof.transfer)
    assert prof.command.startswith("pdserve plan profile")


class FakeEngine:
    """vLLM's `LLMEngine` as the sweep drives it: chunked prefill within a token budget
    per step, a prefix cache of whole blocks, one token per decoding request a step."""

    def __init__(self, budget: int = 256, block: int = 16, drop_one: bool = False):
        self.budget, self.block, self.drop_one = budget, block, drop_one
        self.cache: set[tuple] = set()
        self.running: dict[str, dict] = {}
        self.decode_batches: list[int] = []         # requests per pure decode step

    def add_request(self, rid, prompt, max_tokens):
        ids = prompt["prompt_token_ids"]
        hit = max((k for k in range(0, len(ids), self.block) if tuple(ids[:k]) in self.cache),
                  default=0)
        self.running[rid] = {"ids": ids, "done": hit, "cached": hit, "out": [],
                             "max": max_tokens}

    def step(self):
        budget, outs, prefilling = self.budget, [], False
        for rid, r in list(self.running.items()):
            if r["done"] < len(r["ids"]):
                prefilling = True
                take = min(budget, len(r["ids"]) - r["done"])
                r["done"], budget = r["done"] + take, budget - take
                if r["done"] < len(r["ids"]):
                    continue
                for k in range(self.block, len(r["ids"]) + 1, self.block):
                    self.cache.add(tuple(r["ids"][:k]))
            r["out"].append(7)
            outs.append(SimpleNamespace(request_id=rid, finished=len(r["out"]) >= r["max"],
                                        num_cached_tokens=r["cached"],
                                        outputs=[SimpleNamespace(token_ids=list(r["out"]))]))
            if outs[-1].finished:
                del self.running[rid]
        if not prefilling and outs:
            self.decode_batches.append(len(outs))
        return outs[:-1] if self.drop_one and not prefilling and len(outs) > 1 else outs

    def abort_request(self, rids):
        for rid in rids:
            self.running.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.running)


def test_decode_points_time_only_steps_where_the_whole_batch_decodes():
    engine = FakeEngine()
    timer = Timer(engine, vocab=4000, seed=0, sampling=lambda n: n)
    assert timer.decode(batch=8, context=16 * 6 + 1, steps=5) >= 0
    # Filling 8 x 97 tokens takes several 256-token steps; the timed ones all ran 8.
    assert engine.decode_batches[:5] == [8] * 5 and not engine.running
    with pytest.raises(RuntimeError, match="ran 7 of 8"):
        Timer(FakeEngine(drop_one=True), 4000, 0, lambda n: n).decode(8, 97, 3)


def test_a_cached_prefill_point_reports_the_blocks_the_engine_held():
    timer = Timer(FakeEngine(block=16), vocab=4000, seed=0, sampling=lambda n: n)
    point = timer.prefill(tokens=100, cached=48, reps=2)
    assert point["cached_tokens"] == 48 and point["ms"] >= 0
    assert timer.prefill(tokens=100, cached=0, reps=1)["cached_tokens"] == 0
