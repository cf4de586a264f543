"""The C byte-level detokenizer streams the same text, piece by piece, as the
tokenizer's own DecodeStream: on random ids that split characters across tokens,
with special tokens (skipped), added tokens that are not special (their text
kept whole, the bytes before them closed), unknown ids, and prompts that end
inside a character."""
from __future__ import annotations

import copy
import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models
from tokenizers.decoders import DecodeStream

from pdserve.services.edge import detokenizer
from pdserve.services.edge.detokenizer import StopRule, TextStream, byte_table
from support import c_part


@pytest.fixture
def native():
    """The C module, whichever implementation this process's edge runs."""
    return c_part("bytetext")


@pytest.fixture(scope="module")
def rust(model_dir):
    from transformers import AutoTokenizer
    tok = copy.deepcopy(AutoTokenizer.from_pretrained(model_dir)._tokenizer)
    tok.add_tokens([AddedToken("<tool>", special=False), AddedToken("日本", special=False)])
    return tok


def _ids(rust, rng: random.Random, n: int) -> list[int]:
    """Ids a model might emit, and worse: text, lone bytes, specials, added, unknown."""
    size = rust.get_vocab_size(with_added_tokens=True)
    text = rng.choice(["héllo wörld € 日本語 🙂 ", "plain ascii text ", "a\nb\tc \"q\" \\ "])
    out = rust.encode(text * 2, add_special_tokens=False).ids
    for _ in range(n):
        r = rng.random()
        if r < 0.5:
            out.insert(rng.randrange(len(out) + 1), rng.randrange(5, size))
        elif r < 0.7:
            out.insert(rng.randrange(len(out) + 1), rng.randrange(0, 5))     # specials
        elif r < 0.9:
            out.insert(rng.randrange(len(out) + 1), rng.choice([size - 1, size - 2]))
        else:
            out.insert(rng.randrange(len(out) + 1), size + rng.randrange(10))  # unknown
    return out


def _decode_stream_pieces(rust, prompt, ids):
    stream = DecodeStream(ids=list(prompt), skip_special_tokens=True)
    return [stream.step(rust, i) or "" for i in ids]


@pytest.mark.parametrize("seed", range(60))
def test_pieces_equal_decode_streams(rust, native, seed):
    rng = random.Random(seed)
    table = byte_table(rust)
    assert table is not None
    prompt = _ids(rust, rng, rng.randrange(0, 4))[:rng.randrange(0, 12)]
    ids = _ids(rust, rng, rng.randrange(0, 30))
    stream = native.ByteStream(table, prompt)
    assert [stream.add([i]) for i in ids] == _decode_stream_pieces(rust, prompt, ids)
    # Fed in chunks, each chunk's text is its ids' pieces joined.
    stream = native.ByteStream(table, prompt)
    cuts = sorted(rng.sample(range(len(ids) + 1), k=min(len(ids), 5)))
    pieces = _decode_stream_pieces(rust, prompt, ids)
    for a, b in zip([0, *cuts], [*cuts, len(ids)]):
        assert stream.add(ids[a:b]) == "".join(pieces[a:b])


def test_a_prompt_ending_inside_a_character_comes_out_with_its_completion(rust, native):
    euro = rust.encode("€", add_special_tokens=False).ids
    assert len(euro) > 1, "the test needs a character spelt in several tokens"
    prompt = rust.encode("ab", add_special_tokens=False).ids + euro[:1]
    stream = native.ByteStream(byte_table(rust), prompt)
    assert [stream.add([i]) for i in euro[1:]] == _decode_stream_pieces(rust, prompt, euro[1:])
    assert "".join(stream.add([i]) for i in rust.encode("x", add_special_tokens=False).ids)


def test_text_stream_is_the_same_in_c_and_in_python(rust, native, monkeypatch):
    from types import SimpleNamespace
    tok = SimpleNamespace(_tokenizer=rust)
    rng = random.Random(7)
    ids = _ids(rust, rng, 40)
    rule = StopRule(stop=("wö",), stop_token_ids=frozenset({1}))

    def run(byte_stream):
        monkeypatch.setattr(detokenizer, "ByteStream", byte_stream)
        ts = TextStream(tok, [], rule)
        return [ts.add(ids[i:i + 3]) for i in range(0, len(ids), 3)] + [ts.finish()]
    assert run(native.ByteStream) == run(None)


def test_a_tokenizer_that_is_not_byte_level_gets_no_table():
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    assert byte_table(tok) is None
