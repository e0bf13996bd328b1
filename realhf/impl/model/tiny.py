"""Tiny random-weight Hugging Face models and tokenizers, built locally with no downloads.

These are for tests and CPU smoke runs: every family the conversion code supports gets a small
config with the structural quirks of the real family (Qwen2 q/k/v biases, Llama-3 rope scaling,
GPT-2 learned positions + LayerNorm + tied embeddings, Qwen3 q/k norms and an explicit head_dim),
and weights re-initialised with a visible spread (norm weights not all ones, non-zero biases) so
that comparing two implementations of the same model means something.

Public API::

    FAMILIES
    realhf_cache_dir() -> str
    tiny_hf_config(family, vocab_size, **overrides) -> PretrainedConfig
    tiny_tokenizer(kind="bpe" | "qwen2.5", cache_dir=None) -> PreTrainedTokenizerBase
    build_tiny_hf_model(family, out_dir, seed=1, tokenizer="bpe", dtype=torch.float32, **overrides) -> str
    ensure_tiny_model(family, seed=1, **kw) -> str

The "bpe" tokenizer: byte-level BPE, vocabulary of exactly ``BPE_VOCAB_SIZE`` (1000) tokens,
special tokens ``<|endoftext|>`` (id 0, also the pad token), ``<|im_start|>`` (id 1) and
``<|im_end|>`` (id 2, the eos token: the models are "chat" models, as Qwen2.5-Instruct), no bos
token is prepended, and a ChatML chat template. Models record ``bos_token_id`` = ``<|endoftext|>``
as Qwen does, ``eos_token_id`` = ``<|im_end|>``, ``pad_token_id`` = ``<|endoftext|>``.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from typing import Any, Callable, Iterator

from realhf.base.cache_dir import realhf_cache_dir  # noqa: F401  (part of this module's interface)

import torch

from realhf.base import logging

logger = logging.getLogger(__name__)

FAMILIES = ("qwen2", "llama", "gpt2", "qwen3")
TOKENIZER_KINDS = ("bpe", "qwen2.5")

BPE_VOCAB_SIZE = 1000
BPE_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BPE_EOS = "<|im_end|>"
BPE_PAD = "<|endoftext|>"
# Bump when the corpus, trainer settings or saved format change: it names the cache folder.
_BPE_CACHE_NAME = "tiny_tokenizer_v1"
# Bump when model construction or initialisation changes: it is part of the model cache key.
_TINY_MODEL_VERSION = 1

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_QWEN25_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "data", "tokenizers", "qwen2.5-instruct")

# Round the embedding table up to a multiple of this (the tokenizer ids stay valid: extra rows
# are never produced by the tokenizer).
VOCAB_MULTIPLE = 16


# --------------------------------------------------------------------------- cache helpers


@contextlib.contextmanager
def atomic_dir(final_dir: str, is_complete: Callable[[str], bool] | None = None) -> Iterator[str]:
    """Yield a fresh temporary folder beside ``final_dir``; on success move it to ``final_dir``.

    An interrupted write leaves only a hidden ``.<name>.tmp-*`` folder (removed on the way out),
    never a half-written ``final_dir``. If ``final_dir`` exists already and ``is_complete(final_dir)``
    says it is finished (another process got there first), that one is kept and ours dropped;
    otherwise its files are replaced one by one (each ``os.replace`` is atomic).
    """
    final_dir = os.path.abspath(final_dir)
    parent = os.path.dirname(final_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final_dir)}.tmp-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; a cache folder should not be
    try:
        yield tmp
        try:
            os.rename(tmp, final_dir)
            return
        except OSError:
            if not os.path.isdir(final_dir):
                raise
        if is_complete is not None and is_complete(final_dir):
            logger.info("%s was completed by another process; keeping that one", final_dir)
            return
        # final_dir exists and is not empty: move the files over one at a time, config.json last
        # so that readers that check for it see it only once the rest is in place.
        names = sorted(os.listdir(tmp), key=lambda n: (n == "config.json", n))
        for name in names:
            dst = os.path.join(final_dir, name)
            if os.path.isdir(dst) and not os.path.islink(dst):
                shutil.rmtree(dst)
            os.replace(os.path.join(tmp, name), dst)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- tokenizers

# Qwen2's pre-tokenisation regex (GPT-4 style, but digits are split one by one).
_QWEN_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_WORDS = (
    "the of and to a in is it you that he was for on are with as his they be at one have this from "
    "or had by word but what some we can out other were all there when up use your how said an each "
    "she which do their time if will way about many then them write would like so these her long make "
    "thing see him two has look more day could go come did number sound no most people my over know "
    "water than call first who may down side been now find any new work part take get place made live "
    "where after back little only round man year came show every good me give our under name very "
    "through just form sentence great think say help low line differ turn cause much mean before move "
    "right boy old too same tell does set three want air well also play small end put home read hand "
    "port large spell add even land here must big high such follow act why ask men change went light "
    "kind off need house picture try us again animal point mother world near build self earth father "
    "answer question problem solve step total each price cost sum product difference half twice "
    "apples oranges books pencils marbles cookies coins dollars cents minutes hours days weeks "
    "buys sells gives loses finds eats shares splits earns spends saves collects "
    "Tom Anna Lily Sam Maria John Emma Noah Olivia Liam Ava Lucas Mia Ethan Zoe Ben "
    "therefore first next finally so because let compute calculate equals plus minus times divided "
    "system user assistant you are a helpful assistant please reason step by step final"
).split()

_NAMES = ("Tom", "Anna", "Lily", "Sam", "Maria", "John", "Emma", "Noah", "Olivia", "Liam", "Ava", "Ben")
_ITEMS = ("apples", "oranges", "books", "pencils", "marbles", "cookies", "coins", "stickers", "cards", "eggs")


def _bpe_corpus() -> list[str]:
    """A fixed, deterministically generated text corpus (arithmetic word problems, numbers,
    English words, a little math notation and chat markup)."""
    rng = random.Random(20240601)
    lines: list[str] = []
    # Numbers, so that common digit groups get merged.
    lines.append(" ".join(str(i) for i in range(0, 1000)))
    lines.append(" ".join(str(rng.randint(0, 99999)) for _ in range(500)))
    # Arithmetic word problems with worked answers.
    for _ in range(1500):
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        op = rng.choice(("buys", "finds", "loses", "gives away", "doubles"))
        if op in ("buys", "finds"):
            ans, expr = a + b, f"{a} + {b} = {a + b}"
            q = f"{name} has {a} {item} and {op} {b} more. How many {item} does {name} have now?"
        elif op == "doubles":
            ans, expr = 2 * a, f"2 * {a} = {2 * a}"
            q = f"{name} has {a} {item} and doubles them. How many {item} does {name} have?"
        else:
            hi, lo = max(a, b), min(a, b)
            ans, expr = hi - lo, f"{hi} - {lo} = {hi - lo}"
            q = f"{name} has {hi} {item} and {op} {lo}. How many {item} are left?"
        style = rng.randrange(3)
        if style == 0:
            sol = f"{name} has {expr} {item}. The answer is \\boxed{{{ans}}}."
        elif style == 1:
            sol = f"We compute {expr}.\n#### {ans}"
        else:
            sol = f"Let's think step by step. {expr}. So the final answer is {ans}."
        lines.append(q + "\n" + sol)
    # Bare arithmetic.
    for _ in range(1500):
        a, b = rng.randint(0, 999), rng.randint(1, 999)
        op = rng.choice("+-*/")
        if op == "/":
            lines.append(f"\\frac{{{a}}}{{{b}}} = {a} / {b}")
        else:
            lines.append(f"{a} {op} {b} = {eval(f'{a}{op}{b}')}")  # noqa: S307 (integers only)
    # English word salad.
    for _ in range(1500):
        n = rng.randint(5, 15)
        sent = " ".join(rng.choice(_WORDS) for _ in range(n))
        lines.append(sent[0].upper() + sent[1:] + rng.choice((".", "?", "!", ",")))
    # Chat markup text (the special tokens themselves are added as specials, not learned).
    for _ in range(200):
        lines.append(f"system\nYou are a helpful assistant.\nuser\n{rng.choice(_WORDS)} question\nassistant\n")
    return lines


def _train_bpe():
    """Train the tiny byte-level BPE (deterministic: fixed corpus, fixed settings)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    # The same pipeline as Qwen2's tokenizer (NFC, Qwen's split regex with single digits, byte
    # level): transformers 5 loads any folder whose config says model_type "qwen2" with its own
    # Qwen2Tokenizer, which rebuilds exactly this pipeline around our vocab and merges, so the
    # tokenizer encodes identically whichever class loads it.
    tok = Tokenizer(models.BPE(continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                               byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(BPE_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_bpe_corpus(), trainer=trainer)
    return tok


def _wrap_bpe(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=BPE_EOS,
        pad_token=BPE_PAD,
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHATML_TEMPLATE,
        model_max_length=512,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )


def _bpe_complete(d: str) -> bool:
    return all(os.path.isfile(os.path.join(d, f)) for f in ("tokenizer.json", "tokenizer_config.json"))


def tiny_tokenizer(kind: str = "bpe", cache_dir: str | None = None):
    """Return a tokenizer for tiny models.

    ``kind="qwen2.5"``: the Qwen2.5-Instruct tokenizer shipped in ``realhf/data/tokenizers``
    (151,665 tokens; built by transformers from vocab.json + merges.txt).
    ``kind="bpe"``: a ~1000-token byte-level BPE trained locally (see the module docstring), cached
    in ``cache_dir`` (default ``realhf_cache_dir()/tiny_tokenizer_v1``) and always returned as
    loaded back from that folder, so every call gives the identical tokenizer.
    """
    from realhf.base.hf_tokenizer import load_tokenizer

    if kind == "qwen2.5":
        return load_tokenizer(_QWEN25_DIR)
    if kind != "bpe":
        raise ValueError(f"unknown tiny tokenizer kind {kind!r}; expected one of {TOKENIZER_KINDS}")
    d = os.path.abspath(cache_dir or os.path.join(realhf_cache_dir(), _BPE_CACHE_NAME))
    if not _bpe_complete(d):
        t0 = time.perf_counter()
        wrapped = _wrap_bpe(_train_bpe())
        with atomic_dir(d, _bpe_complete) as tmp:
            wrapped.save_pretrained(tmp)
        logger.info("Trained tiny BPE tokenizer (%d tokens) in %.2fs -> %s", len(wrapped), time.perf_counter() - t0, d)
    return load_tokenizer(d)


def _special_ids(tok) -> dict[str, int | None]:
    """bos/eos/pad ids a model config should record for this tokenizer."""
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    bos = tok.bos_token_id
    if bos is None:
        # Qwen-style tokenizers have no bos token; their configs record <|endoftext|>.
        bos = tok.convert_tokens_to_ids("<|endoftext|>") if "<|endoftext|>" in tok.get_vocab() else eos
    return {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}


# --------------------------------------------------------------------------- configs


def _llama3_rope(theta: float, max_pos: int) -> dict[str, Any]:
    # Llama-3.1 style scaling, shrunk to the tiny context: original context 1/4 of max positions.
    return {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": max(max_pos // 4, 16),
    }


def tiny_hf_config(family: str, vocab_size: int, **overrides):
    """A tiny ``transformers`` config of ``family`` (one of ``FAMILIES``).

    Defaults: hidden 64, 4 layers, 4 attention heads (2 kv heads for GQA families), 512 positions.
    Keyword overrides are config attributes, plus:

    * ``rope_theta``: the rope base (folded into ``rope_parameters``);
    * ``rope_scaling`` (llama, also accepted by qwen2/qwen3): ``True`` for Llama-3.1-style
      ``llama3`` scaling, a dict of rope parameters, or ``None``/``False`` for plain rope;
    * ``tie_word_embeddings`` (default False; GPT-2 always ties and refuses False).
    """
    from transformers import GPT2Config, LlamaConfig, Qwen2Config, Qwen3Config

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    ov = dict(overrides)
    ids = {k: ov.pop(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in ov}

    if family == "gpt2":
        if ov.get("tie_word_embeddings", True) is not True:
            raise ValueError("GPT-2 always ties its input and output embeddings")
        ov.pop("tie_word_embeddings", None)
        for k in ("rope_theta", "rope_scaling"):
            if k in ov:
                raise ValueError(f"GPT-2 has learned positions; {k} does not apply")
        # Accept the llama-style names too.
        alias = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
                 "intermediate_size": "n_inner", "max_position_embeddings": "n_positions"}
        for a, b in alias.items():
            if a in ov:
                ov[b] = ov.pop(a)
        kw: dict[str, Any] = dict(
            vocab_size=vocab_size, n_embd=64, n_layer=4, n_head=4, n_inner=256, n_positions=512,
            activation_function="gelu_new", layer_norm_epsilon=1e-5,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        )
        kw.update(ov)
        kw.update(ids)
        return GPT2Config(**kw)

    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, hidden_act="silu",
        tie_word_embeddings=False, attention_dropout=0.0,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    if family == "qwen2":
        cls, theta, rope_scaling = Qwen2Config, 1_000_000.0, None
        common.update(intermediate_size=128, rms_norm_eps=1e-6, use_sliding_window=False)
    elif family == "qwen3":
        cls, theta, rope_scaling = Qwen3Config, 1_000_000.0, None
        # head_dim * heads != hidden on purpose (as in real Qwen3, e.g. 0.6B: 16 x 128 vs 1024).
        common.update(intermediate_size=128, rms_norm_eps=1e-6, head_dim=32, attention_bias=False,
                      use_sliding_window=False)
    else:  # llama
        cls, theta, rope_scaling = LlamaConfig, 500_000.0, None
        common.update(intermediate_size=128, rms_norm_eps=1e-5, attention_bias=False, mlp_bias=False)

    theta = float(ov.pop("rope_theta", theta))
    rope_scaling = ov.pop("rope_scaling", rope_scaling)
    max_pos = int(ov.get("max_position_embeddings", common["max_position_embeddings"]))
    if "rope_parameters" in ov:
        rope = dict(ov.pop("rope_parameters"))
        rope.setdefault("rope_theta", theta)
    elif rope_scaling is True:
        rope = _llama3_rope(theta, max_pos)
    elif rope_scaling:
        rope = {"rope_theta": theta, **dict(rope_scaling)}
        rope.setdefault("rope_type", rope.pop("type", "default"))
    else:
        rope = {"rope_type": "default", "rope_theta": theta}
    common["rope_parameters"] = rope
    common.update(ov)
    common.update(ids)
    return cls(**common)


# --------------------------------------------------------------------------- models


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _dtype(d) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    name = str(d).replace("torch.", "")
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}
    out = getattr(torch, aliases.get(name, name), None)
    if not isinstance(out, torch.dtype):
        raise ValueError(f"unknown dtype {d!r}")
    return out


@torch.no_grad()
def _reinit_(model: torch.nn.Module, seed: int, std: float = 0.05) -> None:
    """Deterministic, non-trivial weights: N(0, std) matrices and embeddings, norm weights
    1 + 0.1 N(0,1), norm/linear biases 0.05 N(0,1)."""
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + 17)
    norm_params: set[int] = set()
    for mod in model.modules():
        if isinstance(mod, torch.nn.LayerNorm) or "norm" in type(mod).__name__.lower():
            for p in mod.parameters(recurse=False):
                norm_params.add(id(p))
    for name, p in model.named_parameters():  # tied parameters are listed once
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if id(p) in norm_params and name.endswith("weight"):
            val = 1.0 + 0.1 * noise
        elif name.endswith("bias"):
            val = 0.05 * noise
        else:
            val = std * noise
        p.copy_(val.to(p.dtype))


def build_tiny_hf_model(family: str, out_dir: str, seed: int = 1, tokenizer: str = "bpe",
                        dtype=torch.float32, **config_overrides) -> str:
    """Build a tiny random-weight ``family`` model and save it, with its tokenizer, to ``out_dir``.

    The vocabulary is the tokenizer's, rounded up to a multiple of ``VOCAB_MULTIPLE``; bos/eos/pad
    ids come from the tokenizer. Deterministic for given (family, seed, tokenizer, dtype, overrides).
    Returns ``out_dir``.
    """
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    dt = _dtype(dtype)
    tok = tiny_tokenizer(tokenizer)
    ids = _special_ids(tok)
    ov = {**ids, **config_overrides}
    vocab_size = int(ov.pop("vocab_size", _round_up(len(tok), VOCAB_MULTIPLE)))
    if vocab_size < len(tok):
        raise ValueError(f"vocab_size {vocab_size} < tokenizer size {len(tok)}")
    config = tiny_hf_config(family, vocab_size, **ov)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _reinit_(model, seed)
    model = model.to(dt).eval()
    model.config.dtype = dt
    # Chat models stop on eos; pad with the pad token.
    gc = model.generation_config
    gc.bos_token_id, gc.eos_token_id, gc.pad_token_id = ids["bos_token_id"], ids["eos_token_id"], ids["pad_token_id"]
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    n = sum(p.numel() for p in model.parameters())
    logger.info("Built tiny %s model (%.2fM params, vocab %d, seed %d, %s) in %.2fs -> %s",
                family, n / 1e6, vocab_size, seed, str(dt).replace("torch.", ""), time.perf_counter() - t0, out_dir)
    return out_dir


def _model_complete(d: str) -> bool:
    has_weights = os.path.isfile(os.path.join(d, "model.safetensors")) or os.path.isfile(
        os.path.join(d, "model.safetensors.index.json"))
    return has_weights and all(os.path.isfile(os.path.join(d, f)) for f in ("config.json", "tokenizer_config.json"))


def ensure_tiny_model(family: str, seed: int = 1, **kw) -> str:
    """Like :func:`build_tiny_hf_model`, but cached under ``realhf_cache_dir()/tiny_models``,
    keyed by all arguments: the first call builds (atomically), later calls return the path."""
    tokenizer = kw.pop("tokenizer", "bpe")
    dt = _dtype(kw.pop("dtype", torch.float32))
    key_obj = {"v": _TINY_MODEL_VERSION, "family": family, "seed": int(seed), "tokenizer": tokenizer,
               "dtype": str(dt), "overrides": kw}
    key = hashlib.sha256(json.dumps(key_obj, sort_keys=True, default=repr).encode()).hexdigest()[:12]
    name = f"{family}-{tokenizer}-s{seed}-{str(dt).replace('torch.', '')}-{key}"
    d = os.path.join(realhf_cache_dir(), "tiny_models", name)
    if _model_complete(d):
        return d
    with atomic_dir(d, _model_complete) as tmp:
        build_tiny_hf_model(family, tmp, seed=seed, tokenizer=tokenizer, dtype=dt, **kw)
    return d


def main(argv=None) -> int:
    """``python -m realhf.impl.model.tiny --family qwen2 --out DIR``: write a tiny random-weight model."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m realhf.impl.model.tiny", description=main.__doc__)
    p.add_argument("--family", choices=FAMILIES, default="qwen2")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--tokenizer", choices=["bpe", "qwen2.5"], default="bpe")
    a = p.parse_args(argv)
    print(build_tiny_hf_model(a.family, a.out, seed=a.seed, tokenizer=a.tokenizer))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
