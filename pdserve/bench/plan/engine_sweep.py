"""The engine part of `pdserve plan profile`: prefill and decode costs, timed inside one
engine process.

`python -m pdserve.bench.plan.engine_sweep SPEC.json` builds the engine a worker builds
(`services/worker/engine.py`'s `engine_args` from pdserve's `EngineConfig`: the same
dtype, eager mode, block size, chunked prefill and step budget, prefix caching on), with
the worker's process set-up (`pdserve.cli`'s engine environment: KV size, core pinning,
the model in this process), but as vLLM's synchronous `LLMEngine` with no KV connector,
and times its steps:
- prefill: one request of N prompt tokens and `max_tokens=1` alone in the engine, from
  `add_request` to its output (every chunk of a long prompt, and the first token's
  sampling); with a cached fraction f, the request's first ⌊f·N⌋ tokens (whole blocks,
  as the prefix cache holds them) were prefilled just before by another request;
- decode: B requests of C prompt tokens all in their decode phase; one `step()` each
  (schedule, forward, sample, output processing), the median of a few. The prompts
  were prefilled just before (a request each, one output token), so that the B
  requests find all but their last token cached and start decoding in the same step;
  C is a whole number of blocks plus that one token.
It prints one JSON object: {"prefill": [...], "decode": [...], "engine": {...}}.
"""
from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

from pdserve.bench.plan.grid import SweepSpec


def greedy(max_tokens: int):
    """vLLM's sampling for `max_tokens` tokens, every one of them (no early EOS)."""
    from vllm import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


class Timer:
    """A synchronous vLLM engine and the requests it runs, one step at a time."""

    def __init__(self, engine, vocab: int, seed: int, sampling=None):
        self.engine = engine
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.serial = 0
        self.sampling = sampling or greedy

    def tokens(self, n: int) -> list[int]:
        """Random token ids, never a special one (the tiny model's are 0..4): distinct
        prompts, so no prefix cache hit but the ones asked for."""
        return [self.rng.randrange(16, self.vocab) for _ in range(n)]

    def add(self, prompt: list[int], max_tokens: int) -> str:
        self.serial += 1
        rid = f"sweep-{self.serial}"
        self.engine.add_request(rid, {"prompt_token_ids": prompt}, self.sampling(max_tokens))
        return rid

    def run_alone(self, prompt: list[int]) -> tuple[float, int]:
        """(ms, cached prompt tokens) of one request of `prompt` and one output token."""
        t0 = time.perf_counter()
        rid = self.add(prompt, 1)
        while True:
            for out in self.engine.step():
                if out.request_id == rid and out.finished:
                    return (time.perf_counter() - t0) * 1000, out.num_cached_tokens or 0

    def prefill(self, tokens: int, cached: int, reps: int) -> dict:
        """Median ms of `reps` prefills of `tokens` tokens, the first `cached` of each
        computed just before by another request."""
        runs = []
        for _ in range(reps):
            prompt = self.tokens(tokens)
            if cached:
                self.run_alone(prompt[:cached])
            runs.append(self.run_alone(prompt))
        ms = statistics.median(r[0] for r in runs)
        return {"ms": round(ms, 3), "cached_tokens": min(r[1] for r in runs)}

    def decode(self, batch: int, context: int, steps: int) -> float:
        """Median ms of `steps` engine steps with `batch` requests of `context` prompt
        tokens, every one past its prefill."""
        prompts = [self.tokens(context) for _ in range(batch)]
        self.run_all(prompts, 1)          # into the prefix cache: then all start at once
        rids = self.run_all(prompts, steps + 4, until_started=True)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            outs = self.engine.step()
            times.append((time.perf_counter() - t0) * 1000)
            if len(outs) != batch:
                raise RuntimeError(f"a decode step ran {len(outs)} of {batch} requests")
        self.engine.abort_request(list(rids))
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return round(statistics.median(times), 3)

    def run_all(self, prompts: list[list[int]], max_tokens: int,
                until_started: bool = False) -> set[str]:
        """Run `prompts` together until each is done, or (`until_started`) has its
        first token."""
        rids = {self.add(p, max_tokens) for p in prompts}
        done: set[str] = set()
        while done != rids:
            done |= {o.request_id for o in self.engine.step()
                     if o.finished or (until_started and o.outputs[0].token_ids)}
        return rids


def kv_tokens(engine) -> int:
    """How many tokens' KV the engine holds."""
    cache = engine.vllm_config.cache_config
    return int(cache.num_gpu_blocks) * int(cache.block_size)


def sweep(spec: SweepSpec, log=print) -> dict:
    """Build the engine of `spec` in this process and time its prefill and decode points."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    from pdserve.services.worker.engine import engine_args

    cfg = spec.engine_config()
    engine = LLMEngine.from_engine_args(EngineArgs(**engine_args(cfg, "prefill", None),
                                                   disable_log_stats=True))
    timer = Timer(engine, engine.model_config.get_vocab_size(), spec.seed)
    capacity = kv_tokens(engine)
    timer.run_alone(timer.tokens(min(512, spec.max_model_len // 2)))   # first-step costs
    prefill = []
    for tokens, fraction in spec.prefill_points():
        cached = spec.cached_tokens(tokens, fraction)
        point = timer.prefill(tokens, cached, spec.reps)
        prefill.append({"tokens": tokens, "cached_fraction": fraction, **point})
        log(f"prefill {tokens:>6} tokens, {fraction:.2f} cached: {point['ms']:.1f} ms")
    decode = []
    for batch, context in spec.decode_points(capacity):
        step_ms = timer.decode(batch, context, spec.decode_steps)
        decode.append({"batch": batch, "context": context, "step_ms": step_ms})
        log(f"decode batch {batch:>3}, context {context:>6}: {step_ms:.2f} ms a step")
    return {"prefill": prefill, "decode": decode,
            "engine": {"kv_tokens": capacity, "dtype": cfg.dtype,
                       "enable_chunked_prefill": cfg.enable_chunked_prefill,
                       "block_size": cfg.block_size,
                       "max_num_batched_tokens": cfg.max_num_batched_tokens,
                       "max_num_seqs": cfg.max_num_seqs, "max_model_len": cfg.max_model_len}}


def main(argv: list[str]) -> int:
    """Run the sweep of the spec in file argv[0]; its JSON on stdout, progress on stderr."""
    spec = SweepSpec.from_json(json.loads(Path(argv[0]).read_text()))
    from pdserve.cli import _engine_env
    from pdserve.config import KVTransferConfig, WorkerConfig
    _engine_env(WorkerConfig(role="prefill", engine=spec.engine_config(),
                             kv=KVTransferConfig()), spec.cpus)
    out = sys.stdout
    sys.stdout = sys.stderr                  # vLLM's prints stay off the result
    result = sweep(spec, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(result), file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
