"""Bad inputs are found while the experiment is built, before any worker starts (exit code 2, no master log),
with a message naming the file or the config keys: sequences longer than the model's positions, corrupt or
truncated weights, a bad config.json, missing tokenizer files, an oversized data row. Real quickstart runs on
copies of the tiny models (the shared cached folders are never modified)."""
import json
import os
import shutil

import pytest

from realhf.testing import run_quickstart
from realhf.impl.model.tiny import ensure_tiny_model


def _quickstart(args):
    return run_quickstart(args, timeout=180)


def _prompts(path, n=4):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"{i}+1=", "query_id": f"q{i}"}) + "\n")
    return str(path)


def _sft_rows(path, n=8):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n")
    return str(path)


def _fails_before_start(p, root, exp, *needles):
    assert p.returncode == 2, f"exit code {p.returncode}\n{p.stderr[-3000:]}"
    err = p.stderr
    assert "error: " in err, err[-3000:]
    for s in needles:
        assert s in err, f"{s!r} not in the error:\n{err[-3000:]}"
    assert not os.path.exists(os.path.join(root, exp, "trial0", "logs", "master.log")), "a master was started"
    return err


def _gen(model, prompts, root, *extra):
    return _quickstart(["gen", f"model.path={model}", f"dataset.path={prompts}", "dataset.train_bs_n_seqs=2",
                        "use_chat_template=false", f"fileroot={root}", "experiment_name=g", *extra])


# ----------------------------------------------------------------------------- a. sequence length vs positions
def test_gen_longer_than_gpt2_positions(tmp_path):
    root = str(tmp_path)
    model = ensure_tiny_model("gpt2")  # n_positions 512
    p = _gen(model, _prompts(tmp_path / "p.jsonl"), root, "dataset.max_prompt_len=256", "gen.max_new_tokens=300")
    _fails_before_start(p, root, "g", "dataset.max_prompt_len=256", "gen.max_new_tokens=300", "= 556",
                        "n_positions=512", "model.path=", model)


def test_sft_max_seqlen_over_qwen2_positions(tmp_path):
    root = str(tmp_path)
    model = ensure_tiny_model("qwen2", tie_word_embeddings=True)  # max_position_embeddings 512
    p = _quickstart(["sft", f"model.path={model}", f"dataset.train_path={_sft_rows(tmp_path / 's.jsonl')}",
                     "dataset.train_bs_n_seqs=4", "dataset.max_seqlen=1024", f"fileroot={root}", "experiment_name=s"])
    _fails_before_start(p, root, "s", "dataset.max_seqlen=1024", "max_position_embeddings=512", model)


def test_ppo_math_prompt_plus_answer_over_positions(tmp_path):
    from realhf.impl.dataset import make_arithmetic_problems, write_math_jsonl

    root = str(tmp_path)
    model = ensure_tiny_model("qwen2", tie_word_embeddings=True)
    math = str(tmp_path / "m.jsonl")
    write_math_jsonl(make_arithmetic_problems(16, seed=1, kind="add"), math)
    p = _quickstart(["ppo-math", f"actor.path={model}", f"dataset.path={math}", "dataset.train_bs_n_seqs=4",
                     "dataset.max_prompt_len=64", "ppo.gen.max_new_tokens=500", "use_chat_template=false",
                     "use_critic=false", f"fileroot={root}", "experiment_name=p"])
    _fails_before_start(p, root, "p", "dataset.max_prompt_len=64", "ppo.gen.max_new_tokens=500", "= 564",
                        "actor.path", "max_position_embeddings=512")


# ----------------------------------------------------------------------------- b. model folder files
def _truncate_weights(d):
    f = d / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)
    return "model.safetensors is truncated"


def _corrupt_weights_header(d):
    f = d / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.seek(8)
        fh.write(b"\x00garbage\xff")
    return "model.safetensors is corrupt"


def _missing_shard(d):
    """A sharded checkpoint whose index names a second file that is not there."""
    from safetensors import safe_open

    os.rename(d / "model.safetensors", d / "model-00001-of-00002.safetensors")
    with safe_open(str(d / "model-00001-of-00002.safetensors"), "pt") as f:
        names = list(f.keys())
    wm = {n: "model-00001-of-00002.safetensors" for n in names}
    wm[names[-1]] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    return "model-00002-of-00002.safetensors is missing"


def _truncated_config(d):
    text = (d / "config.json").read_text()
    (d / "config.json").write_text(text[: len(text) // 2])
    return "config.json is not valid JSON"


def _incomplete_config(d):
    cfg = json.loads((d / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (d / "config.json").write_text(json.dumps(cfg))
    return "config.json is incomplete"


def _no_tokenizer(d):
    for f in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(d / f)
    return "tokenizer"


BREAKS = [_truncate_weights, _corrupt_weights_header, _missing_shard, _truncated_config, _incomplete_config,
          _no_tokenizer]


@pytest.mark.parametrize("brk", BREAKS, ids=[b.__name__.strip("_") for b in BREAKS])
def test_broken_model_folder_fails_before_start(tmp_path, brk):
    root = str(tmp_path)
    model = tmp_path / "model"
    shutil.copytree(ensure_tiny_model("qwen2", tie_word_embeddings=True), model)
    needle = brk(model)
    p = _gen(str(model), _prompts(tmp_path / "p.jsonl"), root)
    _fails_before_start(p, root, "g", needle, str(model), "model.path=")


def test_broken_tokenizer_json_is_named(tmp_path):
    from realhf.impl.model.conversion.hf_io import check_tokenizer

    model = tmp_path / "model"
    shutil.copytree(ensure_tiny_model("qwen2"), model)
    (model / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "voc')
    with pytest.raises(ValueError, match="the tokenizer in .*model.* does not load"):
        check_tokenizer(str(model))


# ----------------------------------------------------------------------------- c. oversized data row
def test_huge_data_row_is_rejected_by_size(tmp_path):
    root = str(tmp_path)
    data = tmp_path / "s.jsonl"
    _sft_rows(data)
    with open(data, "a") as f:  # line 9: a 50 MB row
        f.write(json.dumps({"prompt": "1+" * (25 << 20), "answer": "x"}) + "\n")
    model = ensure_tiny_model("qwen2", tie_word_embeddings=True)
    p = _quickstart(["sft", f"model.path={model}", f"dataset.train_path={data}", "dataset.train_bs_n_seqs=4",
                     "dataset.max_seqlen=128", f"fileroot={root}", "experiment_name=s"])
    size = os.path.getsize(data) - 8 * len(b'{"prompt": "0+1=", "answer": "1"}\n') - 1
    _fails_before_start(p, root, "s", f"{data}:9", f"{size} bytes", f"limit of {4 << 20} bytes")


# ----------------------------------------------------------------------------- CPU settings read by every worker
@pytest.mark.parametrize("var,value,allowed", [("REALHF_CPU_GEMM", "mkl", "allowed: auto, aten, onednn"),
                                               ("REALHF_CPU_MALLOC", "jemalloc", "allowed: retain, default")])
def test_bad_cpu_setting_fails_before_start(tmp_path, var, value, allowed):
    root = str(tmp_path)
    p = run_quickstart(["gen", f"model.path={ensure_tiny_model('qwen2')}", f"dataset.path={_prompts(tmp_path / 'p.jsonl')}",
                        "dataset.train_bs_n_seqs=2", "use_chat_template=false", f"fileroot={root}", "experiment_name=g"],
                       timeout=180, env={var: value})
    _fails_before_start(p, root, "g", f"{var}={value!r}", allowed)
