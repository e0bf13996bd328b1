"""Shared by the gen engine's tests (test_gen_engine*.py): the tiny model, the in-process references a result is
compared with (batched ``generate``, a fresh model's forward pass), and requests to a RealhfEngine."""
import asyncio
import os
import time

import pytest
import torch

from realhf.api.core.model_api import GenerationHyperparameters
from realhf.gen_server.api import EngineConfig, GenerateRequest, SamplingParams
from realhf.impl.model.tiny import ensure_tiny_model

PROMPT_LENS = [5, 11, 3, 8, 6, 14]


@pytest.fixture(scope="module", name="path")
def path_fixture():
    return ensure_tiny_model("qwen2", tie_word_embeddings=True)


@pytest.fixture(scope="module", name="perturbed")
def perturbed_fixture(path, tmp_path_factory):
    """An HF folder of the tiny model with every weight moved (the 'trained' model of the weight-update tests)."""
    from realhf.testing import perturbed_model

    return perturbed_model(path, str(tmp_path_factory.mktemp("gen_engine")), seed=123)[1]


@pytest.fixture(scope="module", name="ref_model")
def ref_model_fixture(path):
    return _build(path)


def _build(folder):
    from realhf.base.topology import single_process_grid
    from realhf.impl.model.conversion.hf_io import build_from_hf

    return build_from_hf(folder, grid=single_process_grid(), dtype=torch.float32)


def _prompts(vocab=1000, lens=PROMPT_LENS, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def _engine(path, **kw):
    from realhf.gen_server.realhf_engine import RealhfEngine

    return RealhfEngine(EngineConfig(backend="gen", model_path=path, **kw))


def _req(rid, ids, **sampling):
    return GenerateRequest(rid=rid, input_ids=list(ids), sampling=SamplingParams(**sampling).validate())


def _gen(model, prompts, seeds=None, **g):
    """In-process generate: the reference. One thread: a tiny model's small ops only lose time to
    synchronising threads (much time on a busy machine)."""
    from realhf.impl.model.nn.generation import generate

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return generate(model, prompts, GenerationHyperparameters(**g), seeds=seeds)
    finally:
        torch.set_num_threads(threads)


async def _until(cond, what, timeout=120.0):
    """Wait (yielding to the event loop) until ``cond()``; a generous guard against hangs, not a timing check."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


def _fresh_logprobs(model, seqs):
    from realhf.impl.model.nn.real_model import make_packed_input
    from realhf.impl.model.utils.functional import packed_logprobs

    inp = make_packed_input([len(s) for s in seqs])
    ids = torch.tensor([t for s in seqs for t in s])
    with torch.no_grad():
        lp, _ = packed_logprobs(model(ids, inp).float(), ids, inp.cu_seqlens)
    out, off = [], 0
    for s in seqs:
        out.append(lp[off:off + len(s) - 1])
        off += len(s)
    return out


def _max_err(a, b):
    return (torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs().max().item()


def _named_hf(folder):
    """The HF tensors of ``folder`` as a trainer would send them (the tied head included, as a HF
    state_dict lists it)."""
    from safetensors import safe_open

    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        named = {k: f.get_tensor(k) for k in sorted(f.keys())}
    named["lm_head.weight"] = named["model.embed_tokens.weight"].clone()
    return named


def _bad_named(named):
    bad = dict(named)
    bad["model.layers.0.mlp.extra.weight"] = torch.zeros(3)
    return bad
