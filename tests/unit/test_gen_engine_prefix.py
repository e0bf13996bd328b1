"""The gen engine's shared-prompt cache (SharedSlotCache): the samples of a request decode over one copy of its
prompt's keys/values while rows join and leave the running batch, and attend exactly as over their own copies."""
import asyncio

import torch

from realhf.gen_server.engine_batch import SharedSlotCache
from realhf.impl.model.nn.kv_cache import KVCache

LAYERS, HKV, HQ, D = 2, 2, 4, 8
G = torch.Generator().manual_seed(3)


def _prefilled(plens):
    """A decoding KVCache with one row per prompt of ``plens`` tokens, and each prompt's keys/values per layer."""
    c = KVCache(LAYERS, len(plens), max(plens) + 1, HKV, D, torch.float32, "cpu")
    c.begin_prefill(torch.tensor(plens))
    kv = [(torch.randn(sum(plens), HKV, D, generator=G), torch.randn(sum(plens), HKV, D, generator=G))
          for _ in range(LAYERS)]
    for layer, (k, v) in enumerate(kv):
        c.store_prefill(layer, k, v)
    c.end_prefill()
    starts = [sum(plens[:i]) for i in range(len(plens))]
    per_prompt = [[(k[s:s + n].clone(), v[s:s + n].clone()) for k, v in kv] for s, n in zip(starts, plens)]
    return c, per_prompt


def _attend(q, K, V, scale):
    """Plain attention of one row: q [hq, d] over K, V [L, hkv, d]."""
    g = HQ // HKV
    Kq, Vq = K.repeat_interleave(g, dim=1), V.repeat_interleave(g, dim=1)  # [L, hq, d]
    w = torch.einsum("hd,lhd->hl", q, Kq).mul(scale).softmax(-1)
    return torch.einsum("hl,lhd->hd", w, Vq)


def test_shared_slot_cache_attends_like_each_rows_own_sequence():
    cache = SharedSlotCache(LAYERS, HKV, D, torch.float32, "cpu", max_rows=16, max_positions=64)
    seqs = []  # per running row: per layer [K list, V list], in the cache's row order

    def admit(plens, src):
        c, per_prompt = _prefilled(plens)
        cache.add(c, torch.tensor(src), positions=max(plens) + 12)
        for p in src:
            seqs.append([[list(k), list(v)] for k, v in per_prompt[p]])

    def step():
        B = cache.batch
        q, k, v = (torch.randn(B, h, D, generator=G) for h in (HQ, HKV, HKV))
        for layer in range(LAYERS):
            got = cache.decode_attention(layer, q, k, v, 0.3)
            for b in range(B):
                seqs[b][layer][0].append(k[b])
                seqs[b][layer][1].append(v[b])
                want = _attend(q[b], torch.stack(seqs[b][layer][0]), torch.stack(seqs[b][layer][1]), 0.3)
                torch.testing.assert_close(got[b], want, rtol=1e-5, atol=1e-5)
        cache.advance()

    def remove(keep):
        order = cache.remove(keep)
        assert sorted(order) == keep
        seqs[:] = [seqs[i] for i in order]

    admit([5, 9], [0, 0, 0, 1, 1])  # two requests: three and two samples
    assert cache.plens.tolist() == [5, 9] and cache.slots == 3
    step()
    step()
    admit([4, 7], [0, 1, 1, 0])  # a prompt asked for by two requests in one admission shares one copy
    assert cache.plens.tolist() == [5, 9, 4, 7] and cache.slots == 3
    step()
    remove([0, 2, 3, 5, 6, 8])  # rows finish; the last survivors move into the holes
    step()
    assert cache.row_p.tolist() == [0, 3, 0, 1, 2, 2]
    remove([0, 2, 4, 5])  # the last samples of the 9- and 7-token prompts leave: so do their keys/values
    assert cache.plens.tolist() == [5, 4] and cache.row_p.tolist() == [0, 1, 0, 1]
    step()
    step()
    remove([])
    assert cache.batch == 0 and cache.plens.numel() == 0


def test_engine_shares_prompts_and_matches_own_copies():
    """Requests for several samples: the engine with shared prompts gives the samples and log-probs of the engine
    with every sample's own copy, which are those of a fresh forward pass."""
    from support.gen_engine_util import _build, _engine, _fresh_logprobs, _max_err, _prompts, _req

    from realhf.impl.model.tiny import ensure_tiny_model

    path = ensure_tiny_model("qwen2", tie_word_embeddings=True)
    prompts = _prompts(lens=[6, 13, 4])

    async def run(share):
        e = _engine(path, extra={} if share is None else {"share_prefixes": share})
        await e.start()
        try:
            reqs = [e.generate(_req(f"r{i}", p, n=4, seed=10 + i, temperature=1.0, max_new_tokens=16))
                    for i, p in enumerate(prompts)]
            reqs.append(e.generate(_req("greedy", prompts[1], n=2, greedy=True, max_new_tokens=10)))
            out = await asyncio.gather(*reqs)
            return out, type(e._cache).__name__
        finally:
            await e.close()

    shared, kind = asyncio.run(run(True))
    assert kind == "SharedSlotCache"
    own, kind = asyncio.run(run(False))
    assert kind == "SlotCache"
    _, kind = asyncio.run(run(None))  # unset: where it pays; a tiny model's short prompts do not
    assert kind == "SlotCache"
    model = _build(path)
    for a, b in zip(shared, own):
        for oa, ob in zip(a.outputs, b.outputs):
            assert oa.output_ids == ob.output_ids, f"{a.rid}: samples differ with a shared prompt"
            assert _max_err(oa.logprobs, ob.logprobs) < 1e-5
    for r, p in zip(shared, prompts + [prompts[1]]):
        seqs = [p + o.output_ids for o in r.outputs]
        for o, fresh in zip(r.outputs, _fresh_logprobs(model, seqs)):
            assert _max_err(o.logprobs, fresh[len(p) - 1:]) < 1e-4
