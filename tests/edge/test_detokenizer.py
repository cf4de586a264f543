"""The edge's streamed text equals what vLLM's own detokenizer would stream.

Workers speak token ids only; the edge renders text. Each case feeds the same
token chunks to `TextStream` and to vLLM's `IncrementalDetokenizer` (what a
single vLLM server runs) and compares every piece, the whole text, and the
stop string that ended it.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from pdserve.services.edge import detokenizer
from pdserve.services.edge.detokenizer import StopRule, TextStream
from support import c_part

EOS = 3


@pytest.fixture(params=["c", "python"])
def text_path(request, monkeypatch):
    """Each way the edge renders text in turn: the C byte stream, the tokenizer's own."""
    byte_stream = c_part("bytetext").ByteStream if request.param == "c" else None
    monkeypatch.setattr(detokenizer, "ByteStream", byte_stream)


@pytest.fixture(scope="module")
def tokenizers(model_dir):
    from transformers import AutoTokenizer
    from vllm.tokenizers import get_tokenizer
    return AutoTokenizer.from_pretrained(model_dir), get_tokenizer(str(model_dir))


def _vllm_pieces(vtok, prompt, chunks, stop, eos_ends):
    from vllm import SamplingParams
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    params = SamplingParams(stop=list(stop) or None, max_tokens=10_000)
    d = IncrementalDetokenizer.from_new_request(vtok, SimpleNamespace(
        request_id="r", prompt_token_ids=prompt, sampling_params=params))
    pieces, stopped = [], None
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        stopped = d.update(chunk, stop_terminated=last and eos_ends)
        pieces.append(d.get_next_output_text(finished=last or stopped is not None, delta=True))
        if stopped is not None:
            break
    return pieces, stopped


def _mine(tok, prompt, chunks, stop):
    ts = TextStream(tok, prompt, StopRule(stop=tuple(stop), stop_token_ids=frozenset({EOS})))
    pieces = []
    for i, chunk in enumerate(chunks):
        pieces.append(ts.add(chunk))
        if ts.stop_string is not None:
            break
        if i == len(chunks) - 1:
            pieces[-1] += ts.finish()
    return pieces, ts.stop_string


@pytest.mark.parametrize("seed", range(40))
def test_text_pieces_equal_vllms_detokenizer(tokenizers, text_path, seed):
    tok, vtok = tokenizers
    rng = random.Random(seed)
    text = rng.choice(["The quick brown fox, jumps over: the lazy dog. ", "日本語のテキスト ü ß €",
                       "def f(x):\n    return x * 2\n", "a b c d e f g h i j k"])
    out = tok.encode(text * 3, add_special_tokens=False)
    out += [rng.randrange(5, len(tok)) for _ in range(rng.randrange(0, 20))]
    eos_ends = rng.random() < 0.3
    if eos_ends:
        out.append(EOS)
    cuts = sorted(rng.sample(range(1, len(out)), k=min(len(out) - 1, rng.randrange(1, 12))))
    chunks = [out[a:b] for a, b in zip([0, *cuts], [*cuts, len(out)])]
    full = tok.decode(out, skip_special_tokens=True)
    stop = ()
    if rng.random() < 0.6 and len(full) > 10:
        at = rng.randrange(1, len(full) - 4)
        stop = (full[at:at + rng.randrange(1, 5)], "never-there")
    prompt = tok.encode("Say something: ")
    mine, theirs = _mine(tok, prompt, chunks, stop), _vllm_pieces(vtok, prompt, chunks, stop,
                                                                   eos_ends)
    assert "".join(mine[0]) == "".join(theirs[0])
    assert mine == theirs
