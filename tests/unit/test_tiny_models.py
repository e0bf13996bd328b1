"""Tiny random-weight HF models and tokenizers (realhf.impl.model.tiny)."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from realhf.impl.model import tiny
from realhf.impl.model.tiny import (
    FAMILIES,
    atomic_dir,
    build_tiny_hf_model,
    ensure_tiny_model,
    tiny_hf_config,
    tiny_tokenizer,
)

MSGS = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples? Café 🙂"},
]
TEXTS = [
    "Hello world",
    "Tom has 12 apples and buys 7 more. 12 + 7 = 19. The answer is \\boxed{19}.",
    "  leading spaces,\ttabs\nnew lines\n\n and unicode: naïve café 東京 🙂",
    "",
]


@pytest.fixture(scope="module", autouse=True)
def _cache_dir(tmp_path_factory):
    old = os.environ.get("REALHF_CACHE_DIR")
    os.environ["REALHF_CACHE_DIR"] = str(tmp_path_factory.mktemp("realhf_cache"))
    yield
    if old is None:
        os.environ.pop("REALHF_CACHE_DIR", None)
    else:
        os.environ["REALHF_CACHE_DIR"] = old


def _weights(d):
    return load_file(os.path.join(d, "model.safetensors"))


# ----------------------------------------------------------------------------- tokenizers


def test_bpe_tokenizer_properties_and_roundtrip(tmp_path):
    tok = tiny_tokenizer("bpe")
    assert len(tok) == tiny.BPE_VOCAB_SIZE == 1000
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 0
    assert tok.bos_token is None
    for s in TEXTS:
        ids = tok(s).input_ids
        assert all(0 <= i < len(tok) for i in ids)
        assert tok.decode(ids) == s
    # Special tokens are single ids, digits are split one by one (Qwen style).
    assert tok("<|im_start|>user<|im_end|>").input_ids[0] == 1
    assert tok("<|im_start|>user<|im_end|>").input_ids[-1] == 2
    assert len(tok("12345").input_ids) == 5
    # save_pretrained / AutoTokenizer round trip.
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    for s in TEXTS:
        assert tok2(s).input_ids == tok(s).input_ids
    assert tok2.apply_chat_template(MSGS, tokenize=False) == tok.apply_chat_template(MSGS, tokenize=False)


def test_bpe_chat_template():
    tok = tiny_tokenizer("bpe")
    text = tok.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{MSGS[1]['content']}<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(MSGS, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids == tok(text).input_ids
    assert ids.count(1) == 3 and ids.count(2) == 2


def test_bpe_training_is_deterministic(tmp_path):
    a = tiny_tokenizer("bpe", cache_dir=str(tmp_path / "a"))
    b = tiny_tokenizer("bpe", cache_dir=str(tmp_path / "b"))
    assert a.get_vocab() == b.get_vocab()
    ja = json.load(open(tmp_path / "a" / "tokenizer.json"))
    jb = json.load(open(tmp_path / "b" / "tokenizer.json"))
    assert ja["model"]["merges"] == jb["model"]["merges"]
    assert ja == jb
    # A cached tokenizer is reused, not retrained.
    mtime = os.path.getmtime(tmp_path / "a" / "tokenizer.json")
    c = tiny_tokenizer("bpe", cache_dir=str(tmp_path / "a"))
    assert os.path.getmtime(tmp_path / "a" / "tokenizer.json") == mtime
    assert c.get_vocab() == a.get_vocab()


def test_qwen25_tokenizer():
    tok = tiny_tokenizer("qwen2.5")
    assert len(tok) == 151665
    assert tok("Hello world").input_ids == [9707, 1879]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = tok.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>system\nYou are a helpful assistant." in text
    for s in TEXTS:
        assert tok.decode(tok(s).input_ids) == s


def test_unknown_kinds():
    with pytest.raises(ValueError):
        tiny_tokenizer("nope")
    with pytest.raises(ValueError):
        tiny_hf_config("mistral", 1000)
    with pytest.raises(ValueError):
        tiny_hf_config("gpt2", 1000, tie_word_embeddings=False)


# ----------------------------------------------------------------------------- configs


def test_configs():
    q2 = tiny_hf_config("qwen2", 1008)
    assert (q2.hidden_size, q2.num_hidden_layers, q2.num_attention_heads, q2.num_key_value_heads) == (64, 4, 4, 2)
    assert q2.rms_norm_eps == 1e-6 and not q2.tie_word_embeddings
    assert tiny_hf_config("qwen2", 1008, tie_word_embeddings=True).tie_word_embeddings
    ll = tiny_hf_config("llama", 1008)
    assert ll.rope_parameters["rope_type"] == "default" and ll.rms_norm_eps == 1e-5
    ll3 = tiny_hf_config("llama", 1008, rope_scaling=True)
    rp = ll3.rope_parameters
    assert rp["rope_type"] == "llama3" and rp["rope_theta"] == 500000.0
    assert {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"} <= set(rp)
    assert rp["original_max_position_embeddings"] < ll3.max_position_embeddings
    custom = tiny_hf_config("llama", 1008, rope_scaling={"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 2.0,
                                                         "original_max_position_embeddings": 64})
    assert custom.rope_parameters["factor"] == 2.0
    g = tiny_hf_config("gpt2", 1008)
    assert g.tie_word_embeddings and g.activation_function == "gelu_new" and g.n_positions == 512
    q3 = tiny_hf_config("qwen3", 1008)
    assert q3.head_dim * q3.num_attention_heads != q3.hidden_size and q3.num_key_value_heads == 2
    assert tiny_hf_config("qwen3", 1008, num_hidden_layers=2).num_hidden_layers == 2


# ----------------------------------------------------------------------------- models


@pytest.mark.parametrize("family", FAMILIES)
def test_build_reload_and_determinism(family, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d1 = build_tiny_hf_model(family, str(tmp_path / "s1"), seed=1)
    assert d1 == str(tmp_path / "s1")
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert os.path.isfile(os.path.join(d1, f)), f

    model = AutoModelForCausalLM.from_pretrained(d1).eval()
    tok = AutoTokenizer.from_pretrained(d1)
    ref_tok = tiny_tokenizer("bpe")
    cfg = model.config
    assert cfg.model_type == family
    assert cfg.vocab_size == 1008 and cfg.vocab_size % tiny.VOCAB_MULTIPLE == 0 and cfg.vocab_size >= len(tok)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (0, 2, 0)
    assert tok.eos_token_id == cfg.eos_token_id and tok.pad_token_id == cfg.pad_token_id
    assert model.generation_config.eos_token_id == 2

    # Whatever class transformers picks for this model type, it tokenizes like the tiny tokenizer.
    for s in TEXTS + [ref_tok.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)]:
        ids = tok(s).input_ids
        assert ids == ref_tok(s).input_ids
        assert tok.decode(ids) == s
    chat = tok.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")
    plain = tok.decode(tok(chat).input_ids, skip_special_tokens=True)
    assert "<|im_start|>" not in plain and "<|im_end|>" not in plain and "Tom has 3 apples" in plain

    # Family traits.
    sd = model.state_dict()
    if family == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in sd and "model.layers.0.self_attn.o_proj.bias" not in sd
    if family == "qwen3":
        assert "model.layers.0.self_attn.q_norm.weight" in sd
        assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    if family == "gpt2":
        assert "transformer.wpe.weight" in sd and "transformer.h.0.ln_1.bias" in sd
        assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    else:
        assert cfg.num_key_value_heads == 2 and not cfg.tie_word_embeddings
        assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()

    # Non-trivial initialisation: norm weights not all one, biases non-zero.
    norms = [v for k, v in sd.items() if ("norm" in k or ".ln_" in k) and k.endswith("weight")]
    assert norms and all(not torch.allclose(v, torch.ones_like(v)) for v in norms)
    biases = [v for k, v in sd.items() if k.endswith("bias") and v.dtype.is_floating_point]
    assert all(v.abs().sum() > 0 for v in biases)

    # Finite logits of the right shape, with and without padding.
    batch = tok(["Hello world", "1 + 2 = 3, so the answer is 3."], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], cfg.vocab_size)
    assert torch.isfinite(logits).all() and logits.std() > 0.05
    out = model.generate(batch["input_ids"][:1], max_new_tokens=4, do_sample=False)
    assert out.shape[1] <= batch["input_ids"].shape[1] + 4

    # Determinism: same seed -> identical weights; another seed -> different.
    w1 = _weights(d1)
    w1b = _weights(build_tiny_hf_model(family, str(tmp_path / "s1b"), seed=1))
    w2 = _weights(build_tiny_hf_model(family, str(tmp_path / "s2"), seed=2))
    assert w1.keys() == w1b.keys() == w2.keys()
    assert all(torch.equal(w1[k], w1b[k]) for k in w1)
    assert all(not torch.equal(w1[k], w2[k]) for k in w1)


def test_llama3_rope_scaling_model(tmp_path):
    from transformers import AutoModelForCausalLM

    d_plain = build_tiny_hf_model("llama", str(tmp_path / "plain"), seed=3)
    d_scaled = build_tiny_hf_model("llama", str(tmp_path / "scaled"), seed=3, rope_scaling=True)
    a = AutoModelForCausalLM.from_pretrained(d_plain).eval()
    b = AutoModelForCausalLM.from_pretrained(d_scaled).eval()
    assert b.config.rope_parameters["rope_type"] == "llama3"
    ids = torch.arange(3, 203).unsqueeze(0)
    with torch.no_grad():
        la, lb = a(ids).logits, b(ids).logits
    assert torch.isfinite(lb).all()
    assert not torch.allclose(la, lb)  # same weights, different rope


def test_tied_qwen2_and_bf16(tmp_path):
    from transformers import AutoModelForCausalLM

    d = build_tiny_hf_model("qwen2", str(tmp_path / "tied"), seed=1, tie_word_embeddings=True, dtype=torch.bfloat16)
    m = AutoModelForCausalLM.from_pretrained(d)
    assert m.config.tie_word_embeddings
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    assert m.model.embed_tokens.weight.dtype == torch.bfloat16
    assert all(v.dtype == torch.bfloat16 for v in _weights(d).values())
    with torch.no_grad():
        assert torch.isfinite(m(torch.tensor([[5, 6, 7]])).logits.float()).all()


def test_qwen25_tokenizer_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = build_tiny_hf_model("qwen3", str(tmp_path / "q"), seed=1, tokenizer="qwen2.5", num_hidden_layers=1)
    m = AutoModelForCausalLM.from_pretrained(d)
    tok = AutoTokenizer.from_pretrained(d)
    assert m.config.vocab_size == 151680 and len(tok) == 151665
    assert (m.config.bos_token_id, m.config.eos_token_id, m.config.pad_token_id) == (151643, 151645, 151643)
    assert tok("Hello world").input_ids == [9707, 1879]
    with torch.no_grad():
        logits = m(torch.tensor([[9707, 1879, 151645]])).logits
    assert logits.shape == (1, 3, 151680) and torch.isfinite(logits).all()


def test_ensure_tiny_model_caches():
    d = ensure_tiny_model("llama", seed=5)
    d_again = ensure_tiny_model("llama", seed=5)
    assert d == d_again and d.startswith(os.environ["REALHF_CACHE_DIR"])
    mtime = os.path.getmtime(os.path.join(d, "model.safetensors"))
    assert ensure_tiny_model("llama", seed=5) == d
    assert os.path.getmtime(os.path.join(d, "model.safetensors")) == mtime  # a cache hit writes nothing
    others = {ensure_tiny_model("llama", seed=6), ensure_tiny_model("llama", seed=5, rope_scaling=True),
              ensure_tiny_model("llama", seed=5, dtype=torch.bfloat16)}
    assert d not in others and len(others) == 3
    # Leftover temporary folders are not kept.
    parent = os.path.dirname(d)
    assert not [n for n in os.listdir(parent) if ".tmp-" in n]
    # Equal to a fresh build.
    w_cached = _weights(d)
    w_fresh = _weights(build_tiny_hf_model("llama", os.path.join(parent, "..", "fresh"), seed=5))
    assert all(torch.equal(w_cached[k], w_fresh[k]) for k in w_cached)


def test_atomic_dir_interrupted(tmp_path):
    final = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_dir(str(final)) as tmp:
            open(os.path.join(tmp, "config.json"), "w").write("{}")
            raise RuntimeError("interrupted")
    assert not final.exists() and os.listdir(tmp_path) == []
    with atomic_dir(str(final)) as tmp:
        open(os.path.join(tmp, "a.txt"), "w").write("1")
    assert (final / "a.txt").read_text() == "1"
    # Existing (non-empty) folder: files replaced.
    with atomic_dir(str(final)) as tmp:
        open(os.path.join(tmp, "a.txt"), "w").write("2")
    assert (final / "a.txt").read_text() == "2" and os.listdir(tmp_path) == ["out"]
    # Completed by someone else meanwhile: theirs is kept.
    with atomic_dir(str(final), is_complete=lambda d: True) as tmp:
        open(os.path.join(tmp, "a.txt"), "w").write("3")
    assert (final / "a.txt").read_text() == "2" and os.listdir(tmp_path) == ["out"]


def test_bpe_training_same_in_another_process(tmp_path):
    import hashlib
    import subprocess
    import sys

    code = ("import hashlib\nfrom realhf.impl.model.tiny import _train_bpe\n"
            "print(hashlib.sha256(_train_bpe().to_str().encode()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "RAYON_NUM_THREADS": "1"}).stdout.strip()
    assert out == hashlib.sha256(tiny._train_bpe().to_str().encode()).hexdigest()
