"""Reading a Hugging Face model folder without torch: its config.json, the headers of its safetensors files and its
tokenizer, checked so that a bad folder is named before any worker starts. The launcher uses these (it never imports
torch, 2-3 s); :mod:`realhf.impl.model.conversion.hf_io` loads and saves the tensors."""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Tuple

import realhf.impl.model.conversion.families  # noqa: F401  (registers the families)
from realhf.api.core.model_api import ReaLModelConfig, hf_family_for_model_type

_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "added_tokens.json", "chat_template.jinja", "generation_config.json",
)


def _read_json(fname: str, what: str):
    try:
        with open(fname, "rb") as fh:
            return json.loads(fh.read())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{fname} is not valid JSON ({e}); this {what} is corrupt or truncated") from None


def read_hf_config(path: str) -> dict:
    f = os.path.join(path, "config.json")
    if not os.path.isfile(f):
        raise FileNotFoundError(f"no config.json in model folder {path!r}")
    hf = _read_json(f, "model config")
    if not isinstance(hf, dict):
        raise ValueError(f"{f} holds a JSON {type(hf).__name__}, not an object; it is not a model config")
    return hf


def config_from_hf_path(path: str, is_critic: bool = False) -> ReaLModelConfig:
    hf = read_hf_config(path)
    if "model_type" not in hf:
        raise ValueError(f"{path}/config.json has no 'model_type'")
    fam = hf_family_for_model_type(hf["model_type"])
    try:
        cfg = fam.config_from_hf(hf)
    except (KeyError, TypeError, ValueError) as e:  # a key missing or of the wrong type
        raise ValueError(f"{path}/config.json is incomplete or invalid for a {hf['model_type']} model: {e}") from None
    cfg.is_critic = is_critic
    return cfg


def max_positions(path: str) -> Optional[Tuple[str, int]]:
    """(config.json key, value) of the longest sequence the model at ``path`` takes, or None if it says none."""
    hf = read_hf_config(path)
    for key in ("max_position_embeddings", "n_positions"):
        v = hf.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return key, v
    return None


_MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit


def _safetensors_header(fname: str) -> dict:
    """The JSON header of a safetensors file, checked against the file's size; the tensors are not read."""
    size = os.path.getsize(fname)
    with open(fname, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 <= n <= min(size - 8, _MAX_HEADER_BYTES):
            raise ValueError(f"{fname} is truncated or not a safetensors file: its {size} bytes do not hold the "
                             "header its first 8 bytes announce")
        try:
            header = json.loads(f.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, IndexError, TypeError, ValueError):
            raise ValueError(f"{fname} is corrupt: its safetensors header is not a valid tensor table") from None
    if 8 + n + end > size:
        raise ValueError(f"{fname} is truncated: its header describes {8 + n + end} bytes, the file has {size}")
    return header


def _weight_files(path: str) -> Dict[str, str]:
    """HF tensor name -> file, from the index or the single safetensors file (whose header is checked)."""
    idx = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(idx):
        wm = _read_json(idx, "checkpoint index")
        wm = wm.get("weight_map") if isinstance(wm, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise ValueError(f"{idx} has no 'weight_map' object of tensor name -> file; the index is incomplete")
        return {k: os.path.join(path, v) for k, v in wm.items()}
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return {k: single for k in _safetensors_header(single) if k != "__metadata__"}
    raise FileNotFoundError(
        f"no weights in {path!r}: expected model.safetensors or model.safetensors.index.json "
        "(only safetensors checkpoints are supported)"
    )


def check_weight_files(path: str) -> None:
    """Check, without reading any tensor, that every weight file of the HF folder ``path`` exists, has a
    readable header, is as long as its header says, and holds the tensors the index places in it."""
    by_file: Dict[str, List[str]] = {}
    for name, fname in _weight_files(path).items():
        by_file.setdefault(fname, []).append(name)
    for fname, names in by_file.items():
        if not os.path.isfile(fname):
            raise FileNotFoundError(f"{fname} is missing: model.safetensors.index.json in {path!r} places "
                                    f"{len(names)} tensors in it (e.g. {names[0]!r})")
        lacking = [n for n in names if n not in _safetensors_header(fname)]
        if lacking:
            raise ValueError(f"{fname} lacks {len(lacking)} tensors that model.safetensors.index.json places in "
                             f"it (e.g. {lacking[0]!r}); the checkpoint is incomplete")


def check_tokenizer(path: str) -> None:
    """Load the tokenizer of the folder ``path`` as the workers do and check that it encodes text. A check that
    passed before on the same files under the same transformers and tokenizers versions is not repeated
    (:func:`realhf.base.hf_tokenizer.checked_before`): the launcher then imports no transformers (1-2 s)."""
    from realhf.base.hf_tokenizer import check_key, checked_before, load_tokenizer, note_checked

    key = check_key(path, _TOKENIZER_FILES)  # the files as they are before the check (hashed once)
    if checked_before(key):
        return
    present = [f for f in _TOKENIZER_FILES if os.path.isfile(os.path.join(path, f))]
    try:
        tok = load_tokenizer(path)
    except Exception as e:  # transformers and tokenizers raise many types (OSError, ValueError, plain Exception)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"the tokenizer in {path!r} does not load ({type(e).__name__}: {first}); tokenizer "
                         f"files there: {present}") from e
    if not tok("Hello world, 1+1=2.", add_special_tokens=False)["input_ids"]:
        raise ValueError(f"the tokenizer in {path!r} encodes text to no tokens: the folder lacks the tokenizer "
                         f"files (tokenizer.json, or vocab.json + merges.txt, or tokenizer.model); it has {present}")
    note_checked(key, path)


# the files that decide how text becomes token ids (the vocabulary, merges, added and special tokens)
_VOCAB_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                "special_tokens_map.json", "tokenizer_config.json")
_PROBE_TEXTS = ("Hello world, 1+1=2.", "The answer is \\boxed{42}; 3.14159 * 17 = 53.40703",
                "  Leading spaces,\ttabs and\nnew lines; unicode: café, naïve, 数学, 😀")


def tokenizer_difference(path: str, other: str) -> Optional[str]:
    """None when the folders ``path`` and ``other`` hold the same tokenizer, else what differs (for a message).

    Equal bytes of every vocabulary file present in either folder are the same tokenizer (no transformers import);
    otherwise both are loaded and compared: their vocabularies (token -> id) and the ids of a few probe texts."""
    present = [f for f in _VOCAB_FILES if os.path.isfile(os.path.join(path, f)) or os.path.isfile(os.path.join(other, f))]
    if not any(os.path.isfile(os.path.join(other, f)) for f in present):
        return f"{other!r} has no tokenizer files (none of {list(_VOCAB_FILES)})"

    def content(folder, name):
        p = os.path.join(folder, name)
        if not os.path.isfile(p):
            return None
        with open(p, "rb") as f:
            return f.read()

    if all(content(path, f) == content(other, f) for f in present):
        return None
    from realhf.base.hf_tokenizer import load_tokenizer

    a, b = load_tokenizer(path), load_tokenizer(other)
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        diff = sorted(set(va.items()) ^ set(vb.items()), key=lambda kv: kv[1])
        tok = diff[0][0] if diff else "?"
        return (f"their vocabularies differ ({len(va)} and {len(vb)} tokens; e.g. token {tok!r} is id "
                f"{va.get(tok)} in one and {vb.get(tok)} in the other)")
    for text in _PROBE_TEXTS:
        ia = a(text, add_special_tokens=True)["input_ids"]
        ib = b(text, add_special_tokens=True)["input_ids"]
        if list(ia) != list(ib):
            return f"they encode {text!r} differently ({list(ia)[:12]} and {list(ib)[:12]})"
    return None
