"""The decode core (realhf/impl/model/nn/decode_core.py) is what both decode loops run: in-process ``generate`` and
the gen server's engine prefill, step and sample through it. Their results are compared with each other in
test_gen_engine.py; here, that both go through the same core."""
import asyncio

import pytest

from realhf.gen_server import engine_batch, engine_step
from realhf.impl.model.nn import decode_core, generation, sampling

from support.gen_engine_util import _engine, _gen, _prompts, _req
from support.gen_engine_util import path_fixture, ref_model_fixture  # noqa: F401 - the fixtures `path` and `ref_model`


def test_both_paths_sample_with_one_function():
    assert generation.sample_step is decode_core.sample_step is engine_batch.sample_step is sampling.sample_step
    assert generation.Decoder is decode_core.Decoder is engine_step.Decoder


@pytest.fixture
def core_calls(monkeypatch):
    """Counts of the decode core's prefills and steps (the real ones run)."""
    calls = {"prefill": 0, "step": 0}
    for name in calls:
        real = getattr(decode_core.Decoder, name)

        def counted(self, *args, _real=real, _name=name):
            calls[_name] += 1
            return _real(self, *args)

        monkeypatch.setattr(decode_core.Decoder, name, counted)
    return calls


def test_generate_and_engine_drive_the_core(path, ref_model, core_calls):
    prompt = _prompts()[0]
    ref = _gen(ref_model, [prompt], greedy=True, max_new_tokens=5)
    assert core_calls == {"prefill": 1, "step": len(ref.tokens[0]) - 1}

    async def main():
        e = _engine(path)
        await e.start()
        try:
            return await e.generate(_req("r", prompt, greedy=True, max_new_tokens=5))
        finally:
            await e.close()

    before = dict(core_calls)
    res = asyncio.run(main())
    assert res.outputs[0].output_ids == ref.tokens[0]
    assert core_calls == {"prefill": before["prefill"] + 1, "step": before["step"] + len(ref.tokens[0]) - 1}
