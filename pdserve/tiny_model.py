"""Build a tiny random-weight Llama model directory that vLLM can serve.

Why: pdserve's tests and local runs need a real model that vLLM and HF
transformers both load, but the machines it runs on cannot download weights.
This module makes one from scratch, offline, in a few seconds: a 4-layer Llama
with random (seeded) weights and a byte-level BPE tokenizer trained on a
synthetic corpus.  The same seed always gives byte-identical files, so a model
built on one machine behaves exactly like one built on another.

Usage: ``python -m pdserve.tiny_model OUT_DIR [--seed N]`` prints the path.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
from pathlib import Path

BOS, EOT, IM_START, IM_END, PAD = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
SPECIAL_TOKENS = [BOS, EOT, IM_START, IM_END, PAD]  # ids 0..4, in this order
BOS_ID, EOS_ID, PAD_ID = 0, 3, 4  # eos is <|im_end|>: a chat turn ends there
VOCAB_SIZE = 4096
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors",
                  "tokenizer.json", "tokenizer_config.json")

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = {
    "det": "the a this that every some each no one my your our their".split(),
    "adj": ("small large quick slow bright dark warm cold old new green blue red "
            "quiet loud happy tired clever simple strange gentle heavy light early "
            "late empty full distant hidden golden silver wooden broken famous").split(),
    "noun": ("cat dog bird tree river mountain city village house garden road "
             "window door table book letter friend teacher child farmer king queen "
             "ship train station market bridge forest field storm cloud morning "
             "evening night song story idea question answer machine server model "
             "token request network memory engine signal system user assistant").split(),
    "verb": ("sees finds takes makes keeps builds opens closes follows carries "
             "watches writes reads sends answers remembers forgets moves holds "
             "loves visits crosses paints serves measures").split(),
    "adv": ("slowly quickly quietly always never often carefully suddenly "
            "happily gently again together").split(),
    "prep": "near under over behind beside across through into from with".split(),
    "conj": "and but because while although so".split(),
}


def synthetic_corpus(seed: int, n_sentences: int = 30000) -> list[str]:
    """English-like sentences from a fixed word list; deterministic in `seed`."""
    rng = random.Random(seed)
    w = lambda kind: rng.choice(_WORDS[kind])  # noqa: E731

    def phrase() -> str:
        adj = f"{w('adj')} " if rng.random() < 0.5 else ""
        noun = w("noun") + ("s" if rng.random() < 0.2 else "")
        return f"{w('det')} {adj}{noun}"

    lines = []
    for _ in range(n_sentences):
        clause = f"{phrase()} {w('verb')} {phrase()}"
        if rng.random() < 0.4:
            clause += f" {w('prep')} {phrase()}"
        if rng.random() < 0.3:
            clause += f" {w('adv')}"
        if rng.random() < 0.3:
            clause += f", {w('conj')} {phrase()} {w('verb')} {rng.randint(0, 99999)}"
        lines.append(clause[0].upper() + clause[1:] + rng.choice(".!?."))
    return lines


def build_tokenizer(seed: int):
    """Train a byte-level BPE tokenizer and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(synthetic_corpus(seed), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)])
    assert [tok.token_to_id(t) for t in (BOS, IM_END, PAD)] == [BOS_ID, EOS_ID, PAD_ID]
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=IM_END, pad_token=PAD,
        additional_special_tokens=[EOT, IM_START], chat_template=CHAT_TEMPLATE,
        model_max_length=2048, clean_up_tokenization_spaces=False)


def build_tiny_model(out_dir: Path, seed: int = 0) -> Path:
    """Write config, seeded float32 safetensors weights and tokenizer to `out_dir`."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
        # 0.1, not the usual 0.02: at 0.02 greedy output repeats one token and
        # barely depends on earlier context, which would hide KV-cache bugs.
        initializer_range=0.1, tie_word_embeddings=False,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer(seed).save_pretrained(out_dir)
    return out_dir


def long_context_copy(model_dir: Path, out_dir: Path, positions: int) -> Path:
    """The model at `model_dir` with a context of `positions` tokens, in `out_dir`:
    the same weights (linked, not copied) and tokenizer. Llama's rotary positions
    have no learned table, so only the configs change; for benchmarks of long
    prompts (the tiny model itself stops at 2,048)."""
    import json

    model_dir, out_dir = Path(model_dir).resolve(), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for src in model_dir.iterdir():
        if src.is_file() and src.name not in ("config.json", "tokenizer_config.json"):
            (out_dir / src.name).symlink_to(src)
    for name, key in (("config.json", "max_position_embeddings"),
                      ("tokenizer_config.json", "model_max_length")):
        cfg = json.loads((model_dir / name).read_text())
        cfg[key] = positions
        (out_dir / name).write_text(json.dumps(cfg, indent=2))
    return out_dir


def is_complete(model_dir: Path) -> bool:
    return all((Path(model_dir) / name).is_file() for name in REQUIRED_FILES)


def ensure_tiny_model(out_dir: Path, seed: int = 0) -> Path:
    """Build into `out_dir` unless a complete model is already there.

    Builds in a temporary sibling directory and renames it into place, so a
    crash never leaves half a model and concurrent callers never see one.
    """
    out_dir = Path(out_dir)
    if is_complete(out_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        build_tiny_model(tmp, seed)
        tmp.chmod(0o755)  # mkdtemp makes it private
        if out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()  # an empty placeholder would block the rename
        os.rename(tmp, out_dir)
    except OSError:
        if not is_complete(out_dir):  # not a lost race: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)
    print(ensure_tiny_model(args.out_dir, args.seed))


if __name__ == "__main__":
    main()
