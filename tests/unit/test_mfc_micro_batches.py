"""The micro-batch options of an MFC at work (``<mfc>.mb_spec.n_mbs``, ``<mfc>.mb_spec.max_tokens_per_mb``).

test_option_reach.py checks that they arrive in the MFC's definition; here the interfaces run a tiny model in
those micro-batches (counted at the engine), and their outputs do not depend on the cut.
"""
from realhf.impl.model.tiny import ensure_tiny_model


def _tiny_model():
    from realhf.api.core.model_api import Model
    from realhf.base.topology import single_process_grid
    from realhf.impl.model.backend.engine import InferenceEngine
    from realhf.impl.model.conversion.hf_io import build_from_hf

    path = ensure_tiny_model("qwen2", tie_word_embeddings=True)
    grid = single_process_grid()
    return Model(name="actor", engine=InferenceEngine(build_from_hf(path, grid=grid)), tokenizer=None, grid=grid, path=path)


def _counting(engine, method: str):
    """Count the calls of ``engine.<method>``."""
    calls = []
    f = getattr(engine, method)
    setattr(engine, method, lambda *a, **k: calls.append(1) or f(*a, **k))
    return calls


def _sample(seqs, key, prompt_lens=None):
    import torch

    from realhf.api.core.data_api import SequenceSample

    data = {key: torch.cat([torch.tensor(s) for s in seqs])}
    if prompt_lens is not None:
        data["prompt_mask"] = torch.cat([torch.arange(len(s)) < p for s, p in zip(seqs, prompt_lens)])
    return SequenceSample(keys=set(data), ids=list(range(len(seqs))), seqlens={k: [[len(s)] for s in seqs] for k in data},
                          trailing_shapes={k: () for k in data}, dtypes={k: v.dtype for k, v in data.items()}, data=data)


PROMPTS = [[5, 9, 14], [7, 3], [11, 12, 13, 4], [6, 8, 2, 10, 15]]


def test_generation_runs_in_the_mfcs_micro_batches():
    """``mb_spec`` of a generating MFC cuts its prompts into engine calls; the outputs do not depend on the cut."""
    import torch

    from realhf.api.core.dfg import MicroBatchSpec
    from realhf.api.core.model_api import GenerationHyperparameters
    from realhf.impl.model.interface.gen_interface import GenerationInterface

    model = _tiny_model()
    calls = _counting(model.engine, "generate")
    iface = GenerationInterface(GenerationHyperparameters(max_new_tokens=5, n=2), seed=3)
    outs = []
    for mb in (MicroBatchSpec(), MicroBatchSpec(n_mbs=3), MicroBatchSpec(max_tokens_per_mb=5)):
        n0 = len(calls)
        outs.append((iface.generate(model, _sample(PROMPTS, "packed_prompts"), mb), len(calls) - n0))
    assert [n for _, n in outs] == [1, 3, 3]  # within 5 prompt tokens: (3 + 2), 4, 5
    for out, _ in outs[1:]:
        assert torch.equal(out.data["packed_input_ids"], outs[0][0].data["packed_input_ids"])
        torch.testing.assert_close(out.data["packed_logprobs"], outs[0][0].data["packed_logprobs"], atol=1e-5, rtol=1e-5)


def test_inference_runs_in_at_least_n_mbs_micro_batches():
    """``n_mbs`` of an inference MFC (ref_inf, critic_inf) reaches the engine: at least that many forward passes,
    the same log-probs."""
    import torch

    from realhf.api.core.dfg import MicroBatchSpec
    from realhf.api.quickstart.ppo_config import PPOHyperparameters
    from realhf.impl.model.interface.ppo_interface import PPOActorInterface

    model = _tiny_model()
    calls = _counting(model.engine.model, "forward")
    iface = PPOActorInterface(PPOHyperparameters(), group_size=1, use_critic=False, seed=1)
    seqs = [p + [3, 4, 5] for p in PROMPTS]
    data = _sample(seqs, "packed_input_ids", prompt_lens=[len(p) for p in PROMPTS])
    ref = iface.inference(model, data, MicroBatchSpec()).data["logprobs"]
    assert len(calls) == 1
    got = iface.inference(model, data, MicroBatchSpec(n_mbs=3)).data["logprobs"]
    assert len(calls) == 1 + 3
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
