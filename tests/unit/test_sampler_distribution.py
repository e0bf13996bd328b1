"""Every sampling path draws from the distribution it claims, and returns the log-probs it claims.

The claim (``generation.py``, ``sampling.py``, ``realhf_engine.py``): a sampled token is drawn from
softmax(logits / T), stop tokens removed while ``min_new_tokens`` bans them, then restricted to the top-k tokens and
to the top-p nucleus and renormalised; its returned log-prob is log_softmax(logits / T) of the token, before any of
these restrictions. Greedy takes the most likely allowed token, its log-prob at T = 1.

The model is a real tiny Qwen2 checkpoint whose weights are set so that its next-token logits are known: every
block's output projections (attention ``o_proj``, MLP ``down_proj``) are zero, so each block adds nothing to the
residual stream (its attention and MLP still run), the embedding of an even token is ``ones`` and of an odd token
``ones`` with its first half negated, and the head maps these two hidden states to two chosen logit vectors over the
1,008-token vocabulary (both of the inverse-CDF sampler's 512-token blocks). So the next token's distribution
depends on the class (even / odd) of the previous token only: generation is a two-state Markov chain whose
transition probabilities the test knows. The reference logits are read from the model's own forward pass.

Each path is driven the way production drives it, with rows finishing and leaving the batch:
- the leaf sampler ``sample_tokens``: with one shared generator (multinomial) a chi-square on 2,048 rows per class;
  with per-row uniforms (inverse CDF) a deterministic probe of every token's interval of the CDF; and the per-row
  streams themselves (``RowStreams``, with the seeds production derives): uniform, independent, each its own;
- ``generate`` on the PyTorch decode step (the C++ decode ops off);
- ``generate`` on the C++ decode ops as this CPU selects them (op by op without AVX-512);
- ``generate`` on the C++ whole-block decode (``decode_block`` for every layer in one call: what an AVX-512 CPU
  selects; elsewhere selected by declaring its tile kernel worthwhile, which then runs its portable form);
- ``generate`` on the CUDA-graph decoder (``graph_decode.GraphDecoder`` with ``capture=False``, its CPU form);
- realhf's generation engine (``RealhfEngine``: continuous batching, ``engine_batch.sample_groups``), all cases in
  one running batch, so rows of different sampling parameters share steps.

For each (path, case, class of the previous token, banned or not, first token or later), a chi-square test of the
sampled tokens against the known distribution must give p > 1e-4 (fixed seeds: the outcome is deterministic); tokens
outside the allowed set must never appear; every log-prob must match; no two rows draw the same sequence. Seeded
samples must be the same tokens on every path (``seeds`` make sampling independent of the path), but for the rare
sample whose uniform lies within the paths' rounding of the logits of a boundary of the CDF. The compiled decode step
(``compile_decode``) is checked the same way under the ``slow`` mark.
"""
import asyncio
import dataclasses
import json
import os
import shutil
from typing import List, Tuple

import pytest
import torch

from realhf.api.core.model_api import GenerationHyperparameters

ALPHA = 1e-4  # the chi-square test's threshold
LIVE = [3, 8, 17, 64, 255, 300, 511, 512, 513, 640, 777, 901, 1000, 1007]  # tokens with much of the mass
LIVE_LOGITS = [3.0, 2.6, 2.2, 2.0, 1.7, 1.4, 1.1, 0.8, 0.5, 0.2, -0.2, -0.6, -1.0, -1.5]
N_PROMPTS, N_SAMPLES, MAX_NEW = 8, 8, 24  # 64 rows (the C++ decode ops serve up to 64) x 24 steps
SEED0 = 100  # the seed of prompt i is SEED0 + i


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_new: int = 0
    stop: Tuple[int, ...] = ()
    seeded: bool = True  # per-row random streams (inverse CDF); else one shared generator (multinomial)
    greedy: bool = False

    def gen_kwargs(self) -> dict:
        kw = dict(max_new_tokens=MAX_NEW, min_new_tokens=self.min_new, stop_token_ids=list(self.stop))
        if self.greedy:
            return dict(kw, greedy=True)
        return dict(kw, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


CASES = [
    Case("plain-T0.7-streams", temperature=0.7),
    Case("plain-T1.3-generator", temperature=1.3, seeded=False),
    Case("top_p0.95-T1.2-streams", temperature=1.2, top_p=0.95),  # a nucleus of hundreds of tokens
    Case("top_k6-top_p0.9-T1.1-generator", temperature=1.1, top_k=6, top_p=0.9, seeded=False),
    # stop tokens heavy in either class, banned for 8 steps; then rows stop and leave the batch
    Case("ban-T0.7-streams", temperature=0.7, min_new=8, stop=(17, 640)),
    Case("ban-top_p0.8-T0.9-generator", temperature=0.9, top_p=0.8, min_new=8, stop=(17, 640), seeded=False),
    Case("ban-greedy", greedy=True, min_new=8, stop=(3,)),
]
SEEDED = [c for c in CASES if c.seeded and not c.greedy]


# ------------------------------------------------------------------------------------------ the known model


@dataclasses.dataclass
class Known:
    path: str
    logits: torch.Tensor  # [2, V] float64: the model's next-token logits after an even / an odd token
    model: object


def _target_logits(V: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    t = torch.stack([-4.0 + 0.6 * torch.randn(V, generator=g, dtype=torch.float64),
                     -3.5 + 0.6 * torch.randn(V, generator=g, dtype=torch.float64)])
    live = torch.tensor(LIVE_LOGITS, dtype=torch.float64)
    t[0, LIVE], t[1, LIVE] = live, live.flip(0)
    return t


@pytest.fixture(scope="module")
def known(tmp_path_factory) -> Known:
    from safetensors.torch import load_file, save_file

    from realhf.base.topology import single_process_grid
    from realhf.impl.model.conversion.hf_io import build_from_hf
    from realhf.impl.model.nn.real_model import make_packed_input
    from realhf.impl.model.tiny import ensure_tiny_model

    src = ensure_tiny_model("qwen2")  # untied head
    dst = str(tmp_path_factory.mktemp("known_logits"))
    for f in os.listdir(src):
        if f != "model.safetensors":
            shutil.copy(os.path.join(src, f), dst)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    V, H = cfg["vocab_size"], cfg["hidden_size"]
    sd = load_file(os.path.join(src, "model.safetensors"))
    for k, v in sd.items():
        if k.endswith("o_proj.weight") or k.endswith("down_proj.weight"):
            v.zero_()
    h = torch.ones(2, H, dtype=torch.float64)
    h[1, :H // 2] = -1  # the hidden state after an even (row 0) and an odd (row 1) token: orthogonal, rms 1
    sd["model.embed_tokens.weight"] = h.float()[torch.arange(V) % 2].contiguous()
    sd["model.norm.weight"] = torch.ones(H)
    target = _target_logits(V)
    normed = h / (1 + cfg["rms_norm_eps"]) ** 0.5
    sd["lm_head.weight"] = (target.T @ torch.linalg.pinv(normed.T)).float().contiguous()
    save_file(sd, os.path.join(dst, "model.safetensors"))

    model = build_from_hf(dst, grid=single_process_grid(), dtype=torch.float32)
    seqs = [[4, 6, 8], [5, 7, 9]]  # after even tokens, after odd tokens
    inp = make_packed_input([len(s) for s in seqs])
    with torch.no_grad():
        out = model(torch.tensor([t for s in seqs for t in s]), inp).double()
    logits = torch.stack([out[:3].mean(0), out[3:].mean(0)])
    # the same logits at every position, and the ones chosen
    assert (out[:3] - logits[0]).abs().max() < 1e-5 and (out[3:] - logits[1]).abs().max() < 1e-5
    assert (logits - target).abs().max() < 1e-4
    return Known(dst, logits, model)


def _prompts(V: int) -> List[List[int]]:
    """N_PROMPTS prompts of 3-9 tokens whose last tokens alternate even / odd."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(N_PROMPTS):
        p = torch.randint(20, V, (3 + i % 7,), generator=g).tolist()
        p[-1] = p[-1] - p[-1] % 2 + i % 2
        out.append(p)
    return out


# ------------------------------------------------------------------------------------------ the claim


def claimed_probs(logits: torch.Tensor, c: Case, banned: bool) -> torch.Tensor:
    """The distribution ``c`` claims to draw from, from one row of logits [V] (float64)."""
    x = logits.clone() if c.greedy else logits / c.temperature
    if banned:
        x[list(c.stop)] = float("-inf")
    if c.greedy:
        p = torch.zeros_like(x)
        p[x.argmax()] = 1.0
        return p
    if c.top_k:
        x[x < x.topk(c.top_k).values[-1]] = float("-inf")
    p = x.softmax(-1)
    if c.top_p < 1.0:
        v, i = p.sort(descending=True)
        drop = i[(v.cumsum(0) - v) >= c.top_p]  # outside the smallest set whose mass reaches top_p
        p[drop] = 0.0
    return p / p.sum()


def claimed_logprobs(logits: torch.Tensor, c: Case) -> torch.Tensor:
    """[2, V]: the log-probs the samplers return (before banning and truncation; T = 1 for greedy)."""
    return torch.log_softmax(logits / (1.0 if c.greedy else c.temperature), -1)


def _bins(V: int) -> List[torch.Tensor]:
    """Each live token its own bin; the others in four ranges (across the inverse CDF's two blocks)."""
    rest = torch.ones(V, dtype=torch.bool)
    rest[LIVE] = False
    idx = torch.arange(V)
    out = [torch.tensor([t]) for t in LIVE]
    for lo, hi in [(0, 256), (256, 512), (512, 768), (768, V)]:
        out.append(idx[rest & (idx >= lo) & (idx < hi)])
    return out


def check_distribution(tokens: torch.Tensor, probs: torch.Tensor, what: str):
    """Chi-square test of the sampled ``tokens`` against ``probs`` [V] (bins with expected counts below 5 merged),
    and no token of probability 0."""
    n = tokens.numel()
    assert n > 0, what
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    outside = (counts > 0) & (probs == 0)
    assert not outside.any(), f"{what}: sampled tokens outside the allowed set: {outside.nonzero().flatten().tolist()}"
    obs, exp = [], []
    for b in _bins(probs.numel()):
        obs.append(counts[b].sum())
        exp.append(probs[b].sum() * n)
    order = sorted(range(len(exp)), key=lambda i: float(exp[i]))
    o_cells, e_cells, o_small, e_small = [], [], 0.0, 0.0
    for i in order:  # merge the smallest bins until the merged cell expects at least 5
        if e_small < 5.0:
            o_small, e_small = o_small + obs[i], e_small + exp[i]
        else:
            o_cells.append(obs[i])
            e_cells.append(exp[i])
    if e_small > 0:
        o_cells.append(o_small)
        e_cells.append(e_small)
    o, e = torch.tensor(o_cells), torch.tensor(e_cells)
    if o.numel() < 2:
        return
    stat, p = chi_square(o, e)
    assert p > ALPHA, (f"{what}: {n} samples do not follow the claimed distribution (chi-square {stat:.1f}, "
                       f"p = {p:.2e}); observed {o.tolist()} expected {[round(x, 1) for x in e.tolist()]}")


def chi_square(observed: torch.Tensor, expected: torch.Tensor) -> Tuple[float, float]:
    """Pearson's statistic and its p-value (len - 1 degrees of freedom)."""
    stat = ((observed - expected) ** 2 / expected).sum()
    p = torch.special.gammaincc(torch.tensor((observed.numel() - 1) / 2, dtype=torch.float64), stat / 2)
    return stat.item(), p.item()


def check_generation(known: Known, prompts, tokens: List[List[int]], logprobs: List[List[float]], c: Case,
                     what: str):
    """Tokens and log-probs of N_SAMPLES rows per prompt (prompt i // N_SAMPLES) against the claim of ``c``."""
    groups = {}  # (class of the previous token, banned, first token) -> sampled tokens
    lp_err = 0.0
    claimed_lp = claimed_logprobs(known.logits, c)
    for r, (toks, lps) in enumerate(zip(tokens, logprobs)):
        prev = prompts[r // N_SAMPLES][-1]
        assert len(toks) == len(lps) and 0 < len(toks) <= MAX_NEW, (what, r, len(toks))
        for s, (t, lp) in enumerate(zip(toks, lps)):
            groups.setdefault((prev % 2, s < c.min_new, s == 0), []).append(t)  # (the first from the prefill)
            lp_err = max(lp_err, abs(lp - claimed_lp[prev % 2, t].item()))
            prev = t
        stopped = toks[-1] in c.stop and len(toks) > c.min_new
        assert stopped or len(toks) == MAX_NEW, f"{what}: row {r} ended after {len(toks)} tokens without a stop token"
        assert not set(toks[:-1]) & set(c.stop), f"{what}: row {r} went on after a stop token"
    assert lp_err < 1e-4, f"{what}: log-probs differ from log_softmax(logits / T) by up to {lp_err:.2e}"
    for (cls, banned, first), toks in sorted(groups.items()):
        label = (f"{what} [{c.name}, {'first tokens' if first else 'tokens'} after an {'odd' if cls else 'even'} "
                 f"token{', stop tokens banned' if banned else ''}]")
        check_distribution(torch.tensor(toks), claimed_probs(known.logits[cls], c, banned), label)
    if not c.greedy:  # per-row streams or one generator: rows never repeat each other
        assert len({tuple(t) for t in tokens if len(t) >= 8}) == sum(len(t) >= 8 for t in tokens), \
            f"{what} [{c.name}]: two rows drew the same tokens"


# ------------------------------------------------------------------------------------------ the leaf sampler


def _variants(c: Case):
    return [False, True] if c.min_new else [False]


@pytest.mark.parametrize("c", [c for c in CASES if not c.seeded], ids=[c.name for c in CASES if not c.seeded])
def test_shared_generator_draws_the_claimed_distribution(known, c):
    """``sample_tokens`` with one shared generator (multinomial), on 2,048 rows of each class."""
    from realhf.impl.model.nn.sampling import sample_tokens

    rows = 2048
    g = GenerationHyperparameters(**c.gen_kwargs())
    for cls in (0, 1):
        logits = known.logits[cls].float().expand(rows, -1).contiguous()
        for banned in _variants(c):
            stop = torch.tensor(c.stop, dtype=torch.long) if banned else None
            tok, lp = sample_tokens(logits, g, torch.Generator().manual_seed(17 + cls), stop)
            what = f"sample_tokens [{c.name}, class {cls}{', banned' if banned else ''}]"
            check_distribution(tok, claimed_probs(known.logits[cls], c, banned), what)
            want = claimed_logprobs(known.logits, c)[cls, tok]
            assert (lp.double() - want).abs().max() < 1e-4, f"{what}: log-probs differ from log_softmax(logits / T)"


def _probe_cdf(logits: torch.Tensor, c: Case, banned: bool, tokens: List[int], what: str):
    """Per-row streams sample by inverse CDF over the tokens in index order: row uniform u gives the token whose
    interval (F[k-1], F[k]] of the claimed CDF holds u. Probe each listed token's interval near both ends (0.01% of
    its width inside), one row each, through ``sample_tokens``."""
    from realhf.impl.model.nn.sampling import sample_tokens

    probs = claimed_probs(logits.double(), c, banned)
    cdf = probs.cumsum(0)
    us, want = [], []
    for k in tokens:
        lo, p = float(cdf[k] - probs[k]), float(probs[k])
        if p < 1e-5:
            continue
        d = 1e-4 * p + 1e-6
        us += [lo + d, lo + p - d]
        want += [k, k]
    g = GenerationHyperparameters(**c.gen_kwargs())
    stop = torch.tensor(c.stop, dtype=torch.long) if banned else None
    rows = logits.float().expand(len(us), -1).contiguous()
    tok, lp = sample_tokens(rows, g, None, stop, torch.tensor(us, dtype=torch.float64))
    bad = (tok != torch.tensor(want)).nonzero().flatten().tolist()
    assert not bad, (f"{what}: {len(bad)} of {len(us)} probes of the CDF drew another token, e.g. u = {us[bad[0]]:.9f} "
                     f"(in token {want[bad[0]]}'s interval, probability {probs[want[bad[0]]].item():.3e}) drew "
                     f"{int(tok[bad[0]])} (probability {probs[int(tok[bad[0]])].item():.3e})")
    lp_want = torch.log_softmax(logits.double() / c.temperature, -1)[tok]
    assert (lp.double() - lp_want).abs().max() < 1e-4, f"{what}: log-probs differ from log_softmax(logits / T)"
    # and never a token outside the allowed set, for any u (both ends of [0, 1) included)
    tok, _ = sample_tokens(logits.float().expand(2, -1).contiguous(), g, None, stop,
                           torch.tensor([0.0, 1.0 - 2 ** -53], dtype=torch.float64))
    assert (probs[tok] > 0).all(), f"{what}: u at the ends of [0, 1) drew {tok.tolist()}, outside the allowed set"


@pytest.mark.parametrize("c", SEEDED, ids=[c.name for c in SEEDED])
def test_inverse_cdf_draws_each_token_on_its_own_interval(known, c):
    """A deterministic test of the per-row streams' sampler that sees errors far below what a chi-square on random
    draws can (e.g. weights or the CDF in 16-bit floats, a uniform stretched by 0.1%): every token of the known
    model's logits (1,008 tokens: two blocks of the two-level CDF, the second padded), and the 32 most likely and 32
    other tokens of a production-sized vocabulary (49,152 tokens: 96 blocks)."""
    for cls in (0, 1):
        for banned in _variants(c):
            _probe_cdf(known.logits[cls], c, banned, list(range(known.logits.shape[1])),
                       f"inverse CDF [{c.name}, class {cls}{', banned' if banned else ''}]")
    g = torch.Generator().manual_seed(5)
    V = 49152
    big = torch.randn(V, generator=g, dtype=torch.float64) * 2.0
    big[torch.randint(0, V, (40,), generator=g)] += 8.0  # a few likely tokens over a long tail
    big[list(c.stop)] += 6.0
    big = big.float().double()  # as the sampler sees them
    probe = big.topk(32).indices.tolist() + torch.randint(0, V, (32,), generator=g).tolist()
    for banned in _variants(c):
        _probe_cdf(big, c, banned, sorted(set(probe)), f"inverse CDF [{c.name}, {V} tokens]")


def test_row_streams_are_uniform_and_independent():
    """``RowStreams`` with the seeds production derives (``prompt_seed`` of a run's prompts, ``sample_seed`` of their
    8 samples: consecutive seeds): over 2 chunks of steps, the numbers are uniform, a sequence's numbers are
    uncorrelated with its neighbour's (the next sample of the prompt) at the same step and with its own at the next
    step and across the chunk boundary, and a sequence reads its own numbers whichever rows are asked together."""
    from realhf.gen_server.api import sample_seed
    from realhf.impl.model.interface.gen_interface import prompt_seed
    from realhf.impl.model.nn.sampling import RowStreams

    seeds = [sample_seed(prompt_seed(1, version, i), j) for version in (3, 4) for i in range(128) for j in range(8)]
    streams = RowStreams(seeds)
    rows = torch.arange(len(seeds))
    steps = 2 * RowStreams.CHUNK
    u = torch.stack([streams.uniforms(rows, t) for t in range(steps)], 1)  # [sequences, steps]
    counts = torch.histc(u.flatten(), bins=64, min=0.0, max=1.0).double()
    stat, p = chi_square(counts, torch.full_like(counts, u.numel() / 64))
    assert p > ALPHA, f"RowStreams: the numbers are not uniform (chi-square {stat:.1f}, p = {p:.2e})"
    z = (u - 0.5) * 12 ** 0.5  # unit variance
    n_pairs = z[:-1].numel()
    for what, a, b in [("the next sequence at the same step", z[:-1], z[1:]),
                       ("the same sequence at the next step", z[:, :-1], z[:, 1:]),
                       ("the same sequence one chunk later", z[:, :RowStreams.CHUNK], z[:, RowStreams.CHUNK:])]:
        r = (a * b).mean().item()
        assert abs(r) < 5 / n_pairs ** 0.5, f"RowStreams: numbers correlate with {what} (r = {r:.4f})"
    again = RowStreams(seeds)
    for t in (0, 70):  # a subset of the sequences, out of order: each still reads its own stream
        pick = torch.tensor([5, 2000, 17, 2])
        assert torch.equal(again.uniforms(pick, t), u[pick, t])
    for k in (0, 5, 2000):  # its own stream: the generator seeded with its seed (as the engine's rows draw it too)
        own = torch.rand(steps, generator=torch.Generator().manual_seed(seeds[k] % 2**63), dtype=torch.float64)
        assert torch.equal(u[k], own), f"sequence {k} does not read the stream of its seed"


# ------------------------------------------------------------------------------------------ generate


def _generate(model, prompts, c: Case, **extra):
    from realhf.impl.model.nn.generation import generate

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model's steps lose more to synchronising threads than they gain
    try:
        seeds = list(range(SEED0, SEED0 + len(prompts))) if c.seeded else None
        gconfig = GenerationHyperparameters(n=N_SAMPLES, seed=None if c.seeded else 7, **c.gen_kwargs(), **extra)
        return generate(model, prompts, gconfig, seeds=seeds)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def eager_seeded(known):
    """The PyTorch decode step's seeded samples of every case: the tokens every other path must give."""
    from realhf.impl.model.nn import decode_ops

    prompts = _prompts(known.logits.shape[1])
    mp = pytest.MonkeyPatch()
    mp.setattr(decode_ops, "enabled", lambda: False)
    try:
        return {c.name: _generate(known.model, prompts, c) for c in SEEDED}
    finally:
        mp.undo()


def _counted(calls: list, fn):
    def wrapped(*a, **kw):
        y = fn(*a, **kw)
        if y is not None:
            calls.append(1)
        return y

    return wrapped


def _use_path(path: str, monkeypatch) -> list:
    """Select a decode path for ``generate``; returns a list that grows with each step the path served."""
    from realhf.impl.model.nn import decode_ops, graph_decode, real_model

    calls: list = []
    if path.startswith("cpp"):
        from realhf.base import cpp_ext

        if cpp_ext.disabled() or not decode_ops.enabled():
            pytest.skip(f"the C++ decode ops are turned off ({cpp_ext.DISABLE_VAR} or {decode_ops.ENV_VAR})")
        decode_ops._KERNEL.load(strict=True)  # a compiler exists: a failed build fails with its message
    if path == "pytorch":
        monkeypatch.setattr(decode_ops, "enabled", lambda: False)
        monkeypatch.setattr(real_model, "_block_pre", _counted(calls, real_model._block_pre))
        monkeypatch.setattr(real_model, "_BLOCK_EAGER", (real_model._block_pre, real_model._block_post))
    elif path == "cpp-ops":
        monkeypatch.setattr(real_model, "_block_pre_decode", _counted(calls, real_model._block_pre_decode))
        monkeypatch.setattr(real_model, "_BLOCK_DECODE", (real_model._block_pre_decode, real_model._block_post_decode))
        monkeypatch.setattr(real_model, "_decode_layers_whole", _counted(calls, real_model._decode_layers_whole))
    elif path == "cpp-block":
        monkeypatch.setattr(decode_ops, "_tile_kernel_pays", lambda: True)
        monkeypatch.setattr(real_model, "_decode_layers_whole", _counted(calls, real_model._decode_layers_whole))
    else:
        def decoder_for(model):
            d = graph_decode.GraphDecoder(model, capture=False)
            d._run = _counted(calls, d._run)  # every step, sampled inside it or not
            return d

        monkeypatch.setattr(graph_decode, "decoder_for", decoder_for)
    return calls


def check_same_samples(known: Known, prompts, c: Case, tokens: List[List[int]], ref: List[List[int]], what: str):
    """Seeded samples are the reference's. The paths' logits differ in rounding (~1e-7), so
    a row may take another token where its uniform lies that close to a boundary of the CDF (about 1 sample in
    20,000): a row may differ from such a step on, and from no other."""
    from realhf.gen_server.api import sample_seed
    from realhf.impl.model.nn.sampling import RowStreams

    differ = [r for r, (a, b) in enumerate(zip(tokens, ref)) if a != b]
    assert len(differ) <= 2, f"{what} [{c.name}]: seeded samples of rows {differ} differ from the reference path's"
    for r in differ:
        a, b = tokens[r], ref[r]
        s = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
        prev = a[s - 1] if s else prompts[r // N_SAMPLES][-1]
        u = RowStreams([sample_seed(SEED0 + r // N_SAMPLES, r % N_SAMPLES)]).uniforms(torch.tensor([0]), s).item()
        cdf = claimed_probs(known.logits[prev % 2], c, s < c.min_new).cumsum(0)
        assert (cdf - u).abs().min() < 1e-6, (f"{what} [{c.name}]: row {r} drew {a[s]} at step {s} where the reference "
                                              f"drew {b[s]}, with its uniform {u:.9f} not at a boundary of the CDF")


@pytest.mark.parametrize("path", ["pytorch", "cpp-ops", "cpp-block", "graph"])
def test_generate_draws_the_claimed_distribution(known, eager_seeded, path, monkeypatch):
    prompts = _prompts(known.logits.shape[1])
    calls = _use_path(path, monkeypatch)
    for c in CASES:
        n0 = len(calls)
        out = _generate(known.model, prompts, c)
        assert len(calls) > n0, f"{path} [{c.name}]: generate did not take this decode path"
        check_generation(known, prompts, out.tokens, out.logprobs, c, f"generate on the {path} decode step")
        if c.name in eager_seeded:
            check_same_samples(known, prompts, c, out.tokens, eager_seeded[c.name].tokens, f"{path} decode step")


# ------------------------------------------------------------------------------------------ the generation engine


def test_generation_engine_draws_the_claimed_distribution(known, eager_seeded):
    """Every case's requests at once (one per prompt, n = 8) through realhf's engine: its running batch holds rows
    of several sampling parameters at every step, rows join as others finish."""
    from realhf.gen_server.api import EngineConfig, GenerateRequest, SamplingParams
    from realhf.gen_server.realhf_engine import RealhfEngine

    prompts = _prompts(known.logits.shape[1])
    threads = torch.get_num_threads()  # (the engine sets the process's thread count)

    async def main():
        e = RealhfEngine(EngineConfig(backend="gen", model_path=known.path, max_num_seqs=128, seed=5, threads=1))
        await e.start()
        try:
            reqs = [GenerateRequest(rid=f"{c.name}-{i}", input_ids=p, sampling=SamplingParams(
                n=N_SAMPLES, seed=SEED0 + i if c.seeded else None, **c.gen_kwargs()).validate())
                for c in CASES for i, p in enumerate(prompts)]
            return await asyncio.gather(*[e.generate(r) for r in reqs]), e.metrics()
        finally:
            await e.close()

    try:
        res, m = asyncio.run(main())
    finally:
        torch.set_num_threads(threads)
    assert m["max_batch_size"] > 64, "the cases should share the running batch"
    for k, c in enumerate(CASES):
        outs = [o for r in res[k * N_PROMPTS:(k + 1) * N_PROMPTS] for o in r.outputs]
        tokens, lps = [o.output_ids for o in outs], [o.logprobs for o in outs]
        check_generation(known, prompts, tokens, lps, c, "the generation engine")
        if c.name in eager_seeded:
            check_same_samples(known, prompts, c, tokens, eager_seeded[c.name].tokens, "the generation engine")


@pytest.mark.slow
def test_compiled_decode_draws_the_claimed_distribution(known, eager_seeded):
    """``compile_decode``: the decode step compiled by Inductor, sampling inside the graph for greedy and seeded plain
    sampling (``compiled_decode.static_step_fns``), from its logits eagerly otherwise. Slow: compiling costs seconds."""
    prompts = _prompts(known.logits.shape[1])
    for c in CASES:
        out = _generate(known.model, prompts, c, compile_decode=True)
        assert known.model._compiled_decoder.failed is None, known.model._compiled_decoder.failed
        check_generation(known, prompts, out.tokens, out.logprobs, c, "generate on the compiled decode step")
        if c.name in eager_seeded:
            check_same_samples(known, prompts, c, out.tokens, eager_seeded[c.name].tokens, "compiled decode step")
