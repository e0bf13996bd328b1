"""One rule for sampling parameters (``realhf.api.core.sampling_checks``), applied at config time to in-process
generation options and the experiments' ``gen`` sections, and to a generation server's requests: what cannot be
sampled is refused with the field, the value and what is allowed. Requests to a real server are covered in
tests/e2e/test_gen_server_isolation.py."""
import pytest
import torch

from realhf.api.core.model_api import GenerationHyperparameters
from realhf.api.quickstart import config as qc
from realhf.api.quickstart.entry import ConfigError, load_config
from realhf.api.quickstart.ppo_config import GenConfig, SamplingConfig
from realhf.gen_server.api import RequestError, SamplingParams


@pytest.fixture
def paths(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    return str(model), str(data)


BAD = [  # (field, value): refused alike by every place that takes sampling parameters
    ("temperature", 1e-40), ("temperature", float("inf")), ("temperature", 0.0), ("greedy", "false"), ("greedy", 1),
    ("top_k", 2.5), ("top_p", float("nan")), ("min_new_tokens", True), ("seed", "7"), ("stop_token_ids", [3, -1]),
]


@pytest.mark.parametrize("field,value", BAD)
def test_the_same_values_are_refused_in_process_and_by_the_server(field, value):
    with pytest.raises(ValueError, match=rf"^{field}=.*not allowed"):
        GenerationHyperparameters(**{field: value})
    with pytest.raises(ValueError, match=rf"^{field}=.*not allowed"):
        GenConfig(**{field: value})
    with pytest.raises(RequestError, match=rf"^sampling\.{field}=.*not allowed"):
        SamplingParams.from_dict({field: value})


def test_ppo_gen_temperature_is_refused_when_the_config_is_loaded(paths):
    base = [f"actor.path={paths[0]}", f"dataset.path={paths[1]}"]
    with pytest.raises(ConfigError, match=r"ppo\.gen\.temperature=1e-40.*expected a finite number >= 1e-30"):
        load_config(qc.PPOMathConfig, overrides=base + ["ppo.gen.temperature=1e-40"])
    with pytest.raises(ValueError, match=r"greedy='false'.*boolean"):
        SamplingConfig(greedy="false")
    cfg = load_config(qc.PPOMathConfig, overrides=base + ["ppo.gen.temperature=1e-30"])  # the smallest allowed
    assert cfg.ppo.gen.to_hyperparameters().temperature == 1e-30


def test_the_smallest_temperature_samples_finite_log_probs():
    """At the smallest temperature allowed, logits as large as any model's (the fp16 range) are sampled without
    overflow on every sampling path (plain, top-k, top-p; shared or per-row random numbers); a smaller one is
    refused."""
    from realhf.api.core.sampling_checks import LOGIT_BOUND, MIN_TEMPERATURE
    from realhf.impl.model.nn.sampling import sample_with_mask

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=g) * 30
    logits[1, 7], logits[2, 9], logits[2, 10], logits[3] = LOGIT_BOUND, -LOGIT_BOUND, LOGIT_BOUND, -LOGIT_BOUND
    logits[3, 5] = LOGIT_BOUND
    ban = torch.zeros(300, dtype=torch.bool)
    ban[:3] = True
    for top_k, top_p in ((0, 1.0), (5, 1.0), (0, 0.9)):
        for u in (None, torch.rand(4, generator=g, dtype=torch.float64)):
            tok, lp = sample_with_mask(logits.clone(), False, MIN_TEMPERATURE, top_k, top_p, g, ban, u)
            assert torch.isfinite(lp).all() and torch.equal(tok, logits.masked_fill(ban, -1e30).argmax(-1))
    with pytest.raises(ValueError, match="temperature"):
        GenerationHyperparameters(temperature=MIN_TEMPERATURE / 10)


def test_a_stop_list_covering_the_vocabulary_is_refused_with_min_new_tokens():
    from realhf.api.core.sampling_checks import SamplingValueError, check_stop_coverage

    every = list(range(50))
    with pytest.raises(SamplingValueError, match=r"sampling\.stop_token_ids=.*\(50 ids\).*min_new_tokens=2"):
        check_stop_coverage(every, 2, 50, prefix="sampling.")
    check_stop_coverage(every, 0, 50)  # nothing banned: a stop token ends the answer
    check_stop_coverage(every[1:], 2, 50)  # token 0 can be sampled


def test_in_process_generation_and_evaluation_apply_the_same_rule():
    """``generate`` refuses a stop list that covers the model's vocabulary with min_new_tokens (as the server does at
    admission), and the evaluator's sampling temperature takes the same minimum."""
    from realhf.api.core.sampling_checks import SamplingValueError
    from realhf.api.quickstart.eval_config import EvaluatorConfig
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn.generation import generate
    from realhf.impl.model.tiny import ensure_tiny_model

    model = build_from_hf(ensure_tiny_model("qwen2"))
    V = model.config.vocab_size
    g = GenerationHyperparameters(max_new_tokens=4, min_new_tokens=2, stop_token_ids=list(range(V - 1)))
    with pytest.raises(SamplingValueError, match=r"gconfig\.stop_token_ids=.*min_new_tokens=2"):
        generate(model, [[1, 2, 3]], g, eos_token_id=V - 1)
    out = generate(model, [[1, 2, 3]], g)  # one token left to sample before min_new_tokens: it runs
    assert len(out.tokens[0]) >= 2
    with pytest.raises(ValueError, match="temperature=1e-40"):
        EvaluatorConfig(enabled=True, n_sampling=2, temperature=1e-40)
