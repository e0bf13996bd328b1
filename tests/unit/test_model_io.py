"""Checkpoints: save under one layout, load under another; bad checkpoints and layouts fail clearly."""
import json
import os
import shutil

import pytest
import torch

from realhf.testing import run_distributed
from realhf.impl.model.tiny import ensure_tiny_model

LENS = [6, 9, 4]


def _ids(vocab):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=g) for n in LENS]


def _save_worker(src, layout, dst, perturb):
    from realhf.base.topology import ParallelDims, ParallelGrid
    from realhf.impl.model.conversion.hf_io import build_from_hf, save_hf

    grid = ParallelGrid(ParallelDims(*layout))
    model = build_from_hf(src, grid=grid)
    if perturb:  # make the saved weights differ from the source checkpoint (layout-independently)
        model.init_random(seed=5, std=0.05)
    save_hf(model, dst, tokenizer_src=src)
    from realhf.impl.model.conversion.hf_io import gather_full_state

    st = gather_full_state(model)  # collective: every rank takes part
    return st if grid.dp_rank == 0 and grid.tp_rank == 0 else {}


def _state_worker(path, layout):
    from realhf.base.topology import ParallelDims, ParallelGrid
    from realhf.impl.model.conversion.hf_io import build_from_hf, gather_full_state

    grid = ParallelGrid(ParallelDims(*layout))
    st = gather_full_state(build_from_hf(path, grid=grid))
    return st if grid.dp_rank == 0 and grid.tp_rank == 0 else {}


def _merge(results):
    out = {}
    for r in results:
        out.update(r)
    return out


def _logits_worker(path, layout):
    from realhf.api.core.data_api import SequenceSample
    from realhf.base.topology import ParallelDims, ParallelGrid
    from realhf.impl.model.backend.engine import InferenceEngine
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.parallelism.tensor_parallel import gather_from_tp

    grid = ParallelGrid(ParallelDims(*layout))
    model = build_from_hf(path, grid=grid)
    seqs = _ids(model.config.vocab_size)
    s = SequenceSample.from_default(ids=[0, 1, 2], seqlens=LENS, data={"packed_input_ids": torch.cat(seqs)})
    res = InferenceEngine(model).forward(s, post_fn=lambda y, mb: gather_from_tp(y, model.tp_group))
    return torch.cat(res) if model.is_last and grid.tp_rank == 0 else None


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_save_one_layout_load_another(tmp_path, family):
    import transformers

    src = ensure_tiny_model(family, **({"tie_word_embeddings": True} if family == "qwen2" else {}))
    dst = str(tmp_path / "saved")
    saved = _merge(run_distributed(_save_worker, 4, src, (1, 2, 2), dst, True))
    assert os.path.isfile(os.path.join(dst, "model.safetensors.index.json"))
    for layout in [(2, 1, 1), (1, 2, 1)]:
        loaded = _merge(run_distributed(_state_worker, 2, dst, layout))
        for name, t in saved.items():
            if name in loaded:
                assert torch.equal(loaded[name], t), f"{name} changed bits through save (1,2,2) -> load {layout}"
        assert set(saved) - set(loaded) <= {"head.lm_head.weight"}
    a = [r for r in run_distributed(_logits_worker, 1, dst, (1, 1, 1)) if r is not None][0]
    b = [r for r in run_distributed(_logits_worker, 2, dst, (1, 1, 2)) if r is not None][0]
    # parameters are bit-identical (above); logits differ only by float rounding of different micro-batching
    assert (a - b).abs().max() < 1e-5, "the same checkpoint must give the same logits under (1,1,1) and (1,1,2)"
    m = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.cat([m(s[None]).logits[0] for s in _ids(m.config.vocab_size)])
    assert (ref - a).abs().max() < 1e-4
    src_m = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        orig = torch.cat([src_m(s[None]).logits[0] for s in _ids(m.config.vocab_size)])
    assert (orig - a).abs().max() > 1e-2, "perturbed weights should have been saved"
    assert transformers.AutoTokenizer.from_pretrained(dst) is not None


def _build_worker(path, layout):
    from realhf.base.topology import ParallelDims, ParallelGrid
    from realhf.impl.model.conversion.hf_io import build_from_hf

    build_from_hf(path, grid=ParallelGrid(ParallelDims(*layout)))


def test_layout_that_does_not_divide_says_which():
    from realhf.testing import DistributedError

    path = ensure_tiny_model("qwen2")  # 4 heads, 2 kv heads, 4 layers, vocab 1008
    with pytest.raises(DistributedError, match=r"2 key/value heads cannot be split over tensor parallel size 4"):
        run_distributed(_build_worker, 4, path, (1, 4, 1))
    from realhf.api.core.model_api import ReaLModelConfig

    cfg = ReaLModelConfig(n_layers=2, n_q_heads=6, n_kv_heads=3, head_dim=8, hidden_dim=48, intermediate_dim=100, vocab_size=1001)
    with pytest.raises(ValueError, match="vocabulary size 1001") as e:  # 3 kv heads over 2 ranks split 2 + 1
        cfg.check_layout(tp=2, pp=2)
    assert "key/value" not in str(e.value)
    with pytest.raises(ValueError) as e:
        cfg.check_layout(tp=4, pp=3)
    msg = str(e.value)
    assert "3 key/value heads cannot be split over tensor parallel size 4" in msg and "vocabulary size 1001" in msg
    assert "MLP width 100" not in msg and "2 layers cannot fill 3 pipeline stages" in msg


def test_wrong_family_or_shape_names_the_tensor(tmp_path):
    from realhf.base.topology import single_process_grid
    from realhf.impl.model.conversion.hf_io import build_from_hf

    grid = single_process_grid()
    # config says llama, weights are GPT-2's
    bad = tmp_path / "bad_family"
    shutil.copytree(ensure_tiny_model("gpt2"), bad)
    cfg = json.load(open(ensure_tiny_model("llama") + "/config.json"))
    json.dump(cfg, open(bad / "config.json", "w"))
    with pytest.raises(KeyError, match=r"model\.embed_tokens\.weight.*missing"):
        build_from_hf(str(bad), grid=grid)
    # config hidden size disagrees with the tensors
    bad2 = tmp_path / "bad_shape"
    shutil.copytree(ensure_tiny_model("llama"), bad2)
    cfg["intermediate_size"] = cfg["intermediate_size"] * 2
    json.dump(cfg, open(bad2 / "config.json", "w"))
    with pytest.raises(ValueError, match=r"mlp\.gate_proj\.weight.*has shape"):
        build_from_hf(str(bad2), grid=grid)
    with pytest.raises(FileNotFoundError, match="no weights"):
        empty = tmp_path / "empty"
        empty.mkdir()
        json.dump(cfg, open(empty / "config.json", "w"))
        build_from_hf(str(empty), grid=grid)
    with pytest.raises(ValueError, match="unsupported model_type 'bert'"):
        json.dump({"model_type": "bert"}, open(empty / "config.json", "w"))
        build_from_hf(str(empty), grid=grid)
