"""The edge's tokenizer: the ids AutoTokenizer gives, without importing torch."""
from __future__ import annotations

import json
import subprocess
import sys

from transformers import AutoTokenizer

from pdserve.services.edge.openai_protocol import parse_request
from pdserve.services.edge.prompts import PromptEncoder

CHATS = [
    [{"role": "user", "content": "hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"},
     {"role": "assistant", "content": "Scattering."}, {"role": "user", "content": "Ünïcödé, ok?"}],
]


def test_the_edge_encodes_exactly_as_autotokenizer(model_dir):
    encoder, auto = PromptEncoder(str(model_dir)), AutoTokenizer.from_pretrained(str(model_dir))
    for messages in CHATS:
        req = parse_request("chat", json.dumps({"model": "m", "messages": messages}).encode(),
                            {"m"})
        text = auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert encoder.encode(req) == auto.encode(text, add_special_tokens=False)
    # Special tokens spelled in the text, and a long prompt, encode alike too.
    specials = f"{auto.bos_token} a {auto.eos_token}{auto.eos_token} b"
    long = " ".join(auto.decode([t]) for t in range(300, 1500))
    for prompt in ["hello world", "  spaces\tand\nlines ", "Ünïcödé", specials, long]:
        assert encoder.encode_text(prompt) == auto.encode(prompt)
    assert encoder.vocab_size == len(auto)
    assert encoder.tokenizer.eos_token_id == auto.eos_token_id


def test_the_edge_process_does_not_load_torch(model_dir):
    code = ("import sys; from pdserve.services.edge.prompts import PromptEncoder; "
            f"PromptEncoder({str(model_dir)!r}); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "False"
