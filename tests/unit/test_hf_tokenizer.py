"""realhf.base.hf_tokenizer: a folder's tokenizer class is asked of AutoTokenizer once, and the kept class then loads
the same tokenizer without importing AutoTokenizer's tables (the 2.6 s each process paid)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from realhf.base.hf_tokenizer import load_tokenizer_with_route
from realhf.impl.model.tiny import _QWEN25_DIR, FAMILIES, ensure_tiny_model

TEXTS = ["Hello world, 1+1=2.", "  leading spaces\tand tabs\n\nnew lines", "ünïcödé ✓ 数学 🙂", "47+5=52<|endoftext|>"]


def _folders():
    return [ensure_tiny_model(f) for f in FAMILIES] + [_QWEN25_DIR]


def _same(a, b):
    assert type(a) is type(b)
    assert a.get_vocab() == b.get_vocab()
    assert a.special_tokens_map == b.special_tokens_map and a.all_special_ids == b.all_special_ids
    assert (a.eos_token_id, a.pad_token_id, a.bos_token_id) == (b.eos_token_id, b.pad_token_id, b.bos_token_id)
    for t in TEXTS:
        for special in (True, False):
            ids = a(t, add_special_tokens=special)["input_ids"]
            assert ids == b(t, add_special_tokens=special)["input_ids"], t
            assert a.decode(ids) == b.decode(ids)
    if a.chat_template:
        msgs = [{"role": "user", "content": "What is 2+3?"}]
        assert (a.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
                == b.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    folders = _folders()  # built (or found) in the usual cache first
    monkeypatch.setenv("REALHF_CACHE_DIR", str(tmp_path / "cache"))
    return folders


def test_the_kept_class_loads_the_tokenizer_autotokenizer_loads(fresh_cache):
    import transformers

    for path in fresh_cache:
        first, route = load_tokenizer_with_route(path)
        assert route == "auto", path
        kept, route = load_tokenizer_with_route(path)
        assert route == "kept", path
        _same(kept, transformers.AutoTokenizer.from_pretrained(path))
        _same(first, kept)


def test_a_new_process_skips_autotokenizer(fresh_cache):
    path = fresh_cache[0]
    load_tokenizer_with_route(path)
    code = ("import sys, json; from realhf.base.hf_tokenizer import load_tokenizer_with_route as f; "
            f"tok, route = f({path!r}); "
            "print(json.dumps([route, 'transformers.models.auto.tokenization_auto' in sys.modules, "
            "tok('Hello world')['input_ids']]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ)
    route, auto_imported, ids = json.loads(out.stdout.strip().splitlines()[-1])
    assert route == "kept" and not auto_imported
    assert ids == load_tokenizer_with_route(path)[0]("Hello world")["input_ids"]


def test_a_changed_folder_or_remote_code_asks_autotokenizer_again(fresh_cache, tmp_path):
    src = fresh_cache[0]
    d = str(tmp_path / "model")
    shutil.copytree(src, d)
    assert load_tokenizer_with_route(d)[1] == "auto" and load_tokenizer_with_route(d)[1] == "kept"
    cfg_path = os.path.join(d, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["model_max_length"] = 77
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    tok, route = load_tokenizer_with_route(d)
    assert route == "auto" and tok.model_max_length == 77
    # a folder naming remote code never takes a kept class (AutoTokenizer decides, every time)
    cfg["auto_map"] = {"AutoTokenizer": ["no_such_module.Tok", None]}
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    kept = set(os.listdir(os.path.join(os.environ["REALHF_CACHE_DIR"], "tokenizer_class")))
    assert [load_tokenizer_with_route(d)[1] for _ in range(2)] == ["auto", "auto"]
    assert set(os.listdir(os.path.join(os.environ["REALHF_CACHE_DIR"], "tokenizer_class"))) == kept


def test_a_kept_class_that_fails_gives_way_to_autotokenizer(fresh_cache):
    """A kept choice that no longer loads the folder (here: a class of another kind written into the cache) does not
    break the load: AutoTokenizer decides again and its choice is kept."""
    import glob

    path = fresh_cache[0]
    load_tokenizer_with_route(path)
    (kept,) = glob.glob(os.path.join(os.environ["REALHF_CACHE_DIR"], "tokenizer_class", "*.json"))
    with open(kept, "w") as f:
        json.dump({"module": "json", "name": "JSONDecoder"}, f)
    tok, route = load_tokenizer_with_route(path)
    assert route == "auto" and tok("Hello world")["input_ids"]
    assert load_tokenizer_with_route(path)[1] == "kept"
