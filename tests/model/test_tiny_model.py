"""The tiny model builder: deterministic, loadable, and a tokenizer that works."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from safetensors.torch import load_file

from pdserve import tiny_model
from pdserve.tiny_model import BOS_ID, EOS_ID, VOCAB_SIZE, build_tiny_model, ensure_tiny_model


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        "a": build_tiny_model(root / "a", seed=0),
        "b": build_tiny_model(root / "b", seed=0),
        "c": build_tiny_model(root / "c", seed=1),
    }


def test_same_seed_gives_identical_files(built: dict[str, Path]) -> None:
    names = sorted(p.name for p in built["a"].iterdir())
    assert names == sorted(p.name for p in built["b"].iterdir())
    for name in names:
        assert (built["a"] / name).read_bytes() == (built["b"] / name).read_bytes(), name


def test_different_seed_gives_different_weights(built: dict[str, Path]) -> None:
    a = load_file(built["a"] / "model.safetensors")
    c = load_file(built["c"] / "model.safetensors")
    assert a.keys() == c.keys()
    assert not a["model.embed_tokens.weight"].equal(c["model.embed_tokens.weight"])
    assert (built["a"] / "tokenizer.json").read_bytes() != (built["c"] / "tokenizer.json").read_bytes()


def test_config_and_tokenizer_load(built: dict[str, Path]) -> None:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(built["a"])
    tok = AutoTokenizer.from_pretrained(built["a"])
    assert config.model_type == "llama" and config.vocab_size == VOCAB_SIZE == len(tok)
    assert (config.bos_token_id, config.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
    assert (tok.bos_token_id, tok.eos_token_id) == (BOS_ID, EOS_ID)
    assert tok.eos_token == "<|im_end|>"
    weights = load_file(built["a"] / "model.safetensors")
    assert weights["lm_head.weight"].shape == (VOCAB_SIZE, 256)
    assert 0.05 < weights["lm_head.weight"].std().item() < 0.2  # scaled init


def test_greedy_output_is_varied_and_context_dependent(built: dict[str, Path]) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(built["a"])
    model = LlamaForCausalLM.from_pretrained(built["a"], dtype=torch.float32).eval()

    def greedy(text: str) -> list[int]:
        ids = torch.tensor([tok(text)["input_ids"]])
        out = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None,
                             pad_token_id=tok.pad_token_id)
        return out[0, ids.shape[1]:].tolist()

    a = greedy("The quick server sends a request to the distant model")
    b = greedy("A quick server sends a request to the distant model")
    assert len(set(a)) >= 8 and len(set(b)) >= 8  # not one token repeated
    assert a != b  # the first token still matters 10 tokens later


def test_tokenizer_round_trips_text(built: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built["a"])
    for text in ["The quick server sends 123 tokens, because networks are fun!",
                 "  spaces\tand\nnewlines  ", "Ünïcödé text: 日本語 🙂", ""]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    assert tok.encode("hi")[0] == BOS_ID


def test_chat_template_renders_generation_prompt(built: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built["a"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    without = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not without.endswith("assistant\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == BOS_ID and ids.count(EOS_ID) == 2


def test_bpe_merges_words(built: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built["a"])
    rng = random.Random(42)
    words = [w for kind in tiny_model._WORDS.values() for w in kind]
    text = " ".join(rng.choice(words) for _ in range(300))
    n = len(tok.encode(text, add_special_tokens=False))
    assert 300 <= n < 600 < len(text.encode())


def test_ensure_builds_once_and_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "m"
    calls: list[Path] = []

    def fake_build(d: Path, seed: int = 0) -> Path:
        calls.append(d)
        for name in tiny_model.REQUIRED_FILES:
            (d / name).write_text("x")
        return d

    monkeypatch.setattr(tiny_model, "build_tiny_model", fake_build)
    assert ensure_tiny_model(out) == out and tiny_model.is_complete(out)
    assert ensure_tiny_model(out) == out
    assert len(calls) == 1 and calls[0] != out  # built in a temp sibling
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # temp dir gone


def test_ensure_leaves_nothing_on_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(d: Path, seed: int = 0) -> Path:
        (d / "config.json").write_text("{}")
        raise RuntimeError("boom")

    monkeypatch.setattr(tiny_model, "build_tiny_model", crash)
    with pytest.raises(RuntimeError):
        ensure_tiny_model(tmp_path / "m")
    assert list(tmp_path.iterdir()) == []
