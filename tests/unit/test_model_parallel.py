"""ReaLModel against transformers, under every (dp, tp, pp) layout, on real gloo process groups."""
import os

import pytest
import torch

from realhf.api.core.data_api import SequenceSample
from realhf.testing import run_distributed
from realhf.impl.model.tiny import FAMILIES, ensure_tiny_model

LAYOUTS = [(1, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 1), (1, 2, 2), (2, 2, 1)]
LENS = [7, 3, 12, 5, 9, 4]


def _batch(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in LENS]
    return seqs


def _forward_worker(paths, layout, max_tokens_per_mb):
    from realhf.base.topology import ParallelDims, ParallelGrid
    from realhf.impl.model.backend.engine import InferenceEngine
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.parallelism.tensor_parallel import gather_from_tp

    grid = ParallelGrid(ParallelDims(*layout))
    out = {}
    for fam, path in paths.items():
        model = build_from_hf(path, grid=grid)
        seqs = _batch(model.config.vocab_size)
        sample = SequenceSample.from_default(
            ids=list(range(len(seqs))), seqlens=LENS, data={"packed_input_ids": torch.cat(seqs)}
        )
        part = sample.split(grid.dp_size)[grid.dp_rank]
        res = InferenceEngine(model).forward(
            part, max_tokens_per_mb=max_tokens_per_mb, post_fn=lambda y, mb: (mb.ids, gather_from_tp(y, model.tp_group))
        )
        if model.is_last and grid.tp_rank == 0:
            out[fam] = res
    return out


@pytest.fixture(scope="module")
def tiny_paths():
    paths = {fam: ensure_tiny_model(fam) for fam in FAMILIES}
    # 6 query / 3 kv heads: tensor parallelism must split the heads unevenly (4 + 2), like SmolLM2's 9 / 3
    paths["llama-uneven-heads"] = ensure_tiny_model("llama", num_attention_heads=6, num_key_value_heads=3,
                                                    hidden_size=96, tie_word_embeddings=True)
    return paths


@pytest.fixture(scope="module")
def hf_reference(tiny_paths):
    import transformers

    ref = {}
    for fam, path in tiny_paths.items():
        m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        seqs = _batch(m.config.vocab_size)
        with torch.no_grad():
            ref[fam] = [m(s[None]).logits[0] for s in seqs]
    return ref


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"d{d}m{t}p{p}" for d, t, p in LAYOUTS])
def test_logits_match_transformers(layout, tiny_paths, hf_reference):
    world = layout[0] * layout[1] * layout[2]
    results = run_distributed(_forward_worker, world, tiny_paths, layout, 16, timeout=240)
    for fam in tiny_paths:
        got = {}
        for r in results:
            for ids, logits in r.get(fam, []):
                off = 0
                lens = [LENS[i] for i in ids]
                for i, n in zip(ids, lens):
                    got[i] = logits[off : off + n]
                    off += n
        assert sorted(got) == list(range(len(LENS))), f"{fam} {layout}: missing sequences {sorted(got)}"
        for i, ref in enumerate(hf_reference[fam]):
            err = (got[i] - ref).abs().max().item()
            assert err < 1e-4, f"{fam} layout {layout} sequence {i}: max |logit diff| {err:.3g} >= 1e-4"
