"""Batched generation with a KV cache, under any tensor/pipeline layout.

All ranks of one model replica (one data-parallel rank: its tp x pp ranks) call ``generate`` with the
same prompts. Prompts are prefilled packed (no padding); each decode step feeds one token per
unfinished sequence; finished sequences are dropped from the batch and the cache so they stop costing
work. The last stage samples (vocab-parallel logits are gathered only for sampling; its tensor ranks
agree on the samples by a broadcast inside their tp group) and shares the tokens with the other stages.

Returned log-probs are those of the sampled tokens under ``log_softmax(logits / temperature)``
(temperature 1 for greedy), i.e. before top-k/top-p truncation — the same quantity a training forward
pass with that temperature computes.

Schedules
---------
* **Sequential** (pp == 1, or one group): the whole batch goes through the stages one after the
  other at every step (a blocking send per stage, then a broadcast of the sampled tokens over the
  pipeline group). With pp > 1 all stages but one are idle at any moment.
* **Pipelined** (pp > 1, ``G = pipeline_groups`` > 1 groups; default ``G = min(pp, batch)``): the
  batch rows are split into G contiguous groups, each with its own KV cache and its own list of
  unfinished rows. Work items are ``(group g, step r)`` (step 0 = prefill, step r = r-th decode step)
  and every rank walks them in the same round-robin order::

      for r = 0, 1, ...:                 # rounds
          for g = 0 .. G-1:              # groups still running
              if r > 0: consume packet (g, r-1)   # may finish group g -> skipped from now on
              run item (g, r)            # recv activation, forward, send activation / sample

  so while stage s+1 runs item (g, r), stage s runs item (g+1, r) (or (0, r+1)). The tensor ranks of
  a stage run the same item sequence, so their collectives match; each talks to the ranks of the same
  (dp, tp) coordinate in the other stages. Point-to-point messages (receives are blocking; sends are
  non-blocking, and a group's sends of item (g, r-1) are waited for just before its sends of item
  (g, r), when they are known to have been received, so at most one item per group is in flight):

  - activations of item (g, r): stage s -> stage s+1, tag ``_ACT_TAG``;
  - packet of item (g, r) (``[alive rows, 2]`` float64: token, log-prob): last stage -> every other
    stage of the same (dp, tp) coordinate, tag ``_TOK_TAG``. Stage 0 needs it to feed item (g, r+1);
    every stage uses it to drop finished rows from group g's cache and to decide, identically on all
    ranks, whether group g is finished.

  Message sizes follow from the shared bookkeeping (alive rows per group), so there is no shape
  handshake. Each rank sends and receives every message in the global item order, and an item only
  depends on items earlier in that order, so the schedule cannot deadlock. Besides the distinct tags,
  each directed (src, dst) pair carries a single kind of message (activations go s -> s+1, packets go
  last -> s < last), so the messages cannot be confused even on a backend that ignores tags.
  With G == pp the first stage always has G - 1 other groups to run while a group's tokens travel
  through the pipeline and back.

The sequential schedule drives the decode core (``decode_core.py``: prefill, one decode step over the decoder
chosen once, ``sample_step``), which the generation server's engine drives too; the pipelined schedule keeps its own
loop over the same pieces.

In both schedules the ``n`` samples of a prompt (adjacent rows) share one prefill: each distinct prompt
is prefilled once (per row group in the pipelined schedule, where a group may hold only some of a
prompt's samples). With ``n > 1`` and prompts long enough to pay (``kv_cache.sharing_pays``) its samples then
also share its keys/values while they decode (``SharedPrefixCache``: the prompt is read once per step for all of
them, not once per sample); otherwise, or under the compiled decode step, its cache row is copied for each sample.

Results do not depend on the schedule (greedy tokens, and samples drawn with per-row ``seeds``, are the
same as with pp == 1), except that draws from one shared unseeded ``generator`` are taken group by group
in the pipelined schedule, so which sequence gets which random number differs from the sequential one.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from realhf.api.core.model_api import GenerationHyperparameters
from realhf.api.core.sampling_checks import check_stop_coverage
from realhf.impl.model.nn import cpu_gemm, kv_cache
from realhf.impl.model.nn.decode_core import Decoder, SamplingKey, decode_input, prefill_input, sample_step
from realhf.impl.model.nn.kv_cache import KVCache, SharedPrefixCache
from realhf.impl.model.nn.real_model import PackedInput, ReaLModel, even_range
from realhf.impl.model.nn.sampling import RowStreams
from realhf.impl.model.parallelism.tensor_parallel import gather_from_tp


@dataclasses.dataclass
class GenerationOutput:
    tokens: List[List[int]]  # generated ids per sequence (prompt excluded; stop token included)
    logprobs: List[List[float]]  # log-prob of each generated token
    no_eos: List[bool]  # True where the sequence hit max_new_tokens without a stop token
    versions: Optional[List[List[int]]] = None  # weight version behind each generated token (generation servers)


# Message tags of the pipelined schedule (see the module docstring).
_ACT_TAG = 1001  # activations of one work item, stage s -> stage s+1
_TOK_TAG = 1002  # (token, log-prob) packet of one work item, last stage -> every other stage


def _sample_packet(model: ReaLModel, out: torch.Tensor, key: SamplingKey, generator: Optional[torch.Generator],
                   banned: Optional[torch.Tensor], row_u: Optional[torch.Tensor], tp_src: Optional[int]) -> torch.Tensor:
    """On the last stage: sample one token per row of the head output ``out`` -> ``[rows, 2]`` float64
    (token id, log-prob). Every tensor rank samples; they all keep tensor rank 0's result."""
    logits = gather_from_tp(out.float(), model.tp_group)
    tok, lp = sample_step(logits, key, generator, banned=banned, row_u=row_u)
    packed = torch.empty(out.shape[0], 2, dtype=torch.float64, device=out.device)
    packed[:, 0] = tok.double()
    packed[:, 1] = lp.double()
    if tp_src is not None:
        dist.broadcast(packed, src=tp_src, group=model.tp_group)
    return packed


def _record(rows: List[int], tl: List[int], ll: List[float], stop: set, tokens: List[List[int]],
            logps: List[List[float]], no_eos: List[bool]) -> List[int]:
    """Append one step's samples (``tl``/``ll``, one per entry of ``rows``: original sequence indices) to
    the outputs; return the positions in ``rows`` of the sequences that did not stop. Rows < 0 are skipped."""
    keep = []
    for j, orig in enumerate(rows):
        if orig < 0:  # a finished row left in a CUDA graph's batch (see _mark_finished)
            continue
        tokens[orig].append(tl[j])
        logps[orig].append(ll[j])
        if tl[j] in stop:
            no_eos[orig] = False
        else:
            keep.append(j)
    return keep


def _distinct_rows(rows: Sequence[int], n: int) -> Tuple[List[int], List[int]]:
    """The first of ``rows`` (ascending) of each distinct prompt, and how many of ``rows`` each stands for. The samples
    of a prompt are ``n`` adjacent rows (row i holds prompt i // n)."""
    firsts, counts = [], []
    for i in rows:
        if firsts and i // n == firsts[-1] // n:
            counts[-1] += 1
        else:
            firsts.append(i)
            counts.append(1)
    return firsts, counts


def _prefill_input(prompts: List[List[int]], rows: Sequence[int], n: int, cache: KVCache, device):
    """The prefill of ``prompts[i]`` for ``i`` in ``rows`` (ascending) into ``cache``, each distinct prompt once.

    Returns the packed input (the head runs on each prompt's last token only), the token ids, and ``copies``:
    how many of ``rows`` each prefilled prompt stands for (``_end_prefill`` copies its cache row that often;
    the caller repeats its head output to match)."""
    firsts, counts = _distinct_rows(rows, n)
    inp, ids = prefill_input([prompts[i] for i in firsts], cache, device)
    return inp, ids, torch.tensor(counts, dtype=torch.long, device=device)


def _expand_prefill(cache: KVCache, copies: torch.Tensor, shared_max_new: Optional[int] = None) -> KVCache:
    """After the prefill (``cache`` decoding): the cache to decode with, holding each prefilled row once per sample it
    stands for. With ``shared_max_new`` (the samples of a prompt decode together), a :class:`SharedPrefixCache` that
    keeps each prompt's keys/values once for all its samples, with room for that many new tokens; otherwise ``cache``
    itself, its rows copied."""
    if shared_max_new is not None:
        return SharedPrefixCache.from_prefill(cache, copies, shared_max_new)
    cache.keep(torch.arange(copies.numel(), device=copies.device).repeat_interleave(copies))
    return cache


def _end_prefill(cache: KVCache, copies: torch.Tensor, shared_max_new: Optional[int] = None) -> KVCache:
    """After the prefill's forward: end it and expand the cache (``_expand_prefill``)."""
    cache.end_prefill()
    return _expand_prefill(cache, copies, shared_max_new)


def _share_prefixes(model: ReaLModel, prompts: List[List[int]], gconfig: GenerationHyperparameters,
                    compiled: bool) -> bool:
    """Whether the samples of a prompt decode over one shared copy of its keys/values (``SharedPrefixCache``): with
    several samples per prompt, where the keys/values saved from re-reading are worth it (``kv_cache.sharing_pays``),
    unless the compiled decode step runs (it reads whole-sequence caches). ``prompts`` holds each prompt ``n`` times."""
    if gconfig.n <= 1 or compiled:
        return False
    lens = [len(p) for p in prompts[::gconfig.n]]
    return kv_cache.sharing_pays(lens, [gconfig.n] * len(lens), model.n_local_kv_heads, model.config.head_dim,
                                 gconfig.cache_dtype(model.dtype).itemsize)


def _drop_finished(cache: KVCache, keep: List[int], alive: torch.Tensor, tok: torch.Tensor):
    """Keep only the rows at positions ``keep`` (of ``alive``/``tok`` and the cache); returns (alive, tok)."""
    if len(keep) == alive.numel():
        return alive, tok
    kt = torch.tensor(keep, dtype=torch.long, device=alive.device)
    cache.keep(kt)
    return alive[kt], tok[kt]


def _mark_finished(keep: List[int], alive: torch.Tensor) -> torch.Tensor:
    """``alive`` with -1 at every position not in ``keep``: the finished rows stay in the batch (their outputs are
    ignored), so a CUDA graph captured on the cache's buffers keeps serving."""
    kt = torch.tensor(keep, dtype=torch.long, device=alive.device)
    out = torch.full_like(alive, -1)
    out[kt] = alive[kt]
    return out


class _Run:
    """What both schedules of one ``generate`` call share: its inputs, the sampling of the last stage, the outputs."""

    def __init__(self, model: ReaLModel, prompts: List[List[int]], gconfig: GenerationHyperparameters, stop: set,
                 generator: Optional[torch.Generator], row_seeds: Optional[List[int]]):
        self.model, self.prompts, self.gconfig, self.stop = model, prompts, gconfig, stop
        self.generator, self.row_seeds = generator, row_seeds
        self.stop_t = torch.tensor(sorted(stop), dtype=torch.long, device=model.device)
        self.key = SamplingKey.of(gconfig)
        self.max_len = max(len(p) for p in prompts) + gconfig.max_new_tokens + 1
        grid = model.grid
        self.tp_src = grid.global_rank_of(grid.pp_rank, grid.dp_rank, 0) if model.tp > 1 else None
        B = len(prompts)
        self.tokens: List[List[int]] = [[] for _ in range(B)]
        self.logps: List[List[float]] = [[] for _ in range(B)]
        self.no_eos = [True] * B

    def cache(self, n_rows: int, length: int) -> KVCache:
        """A KV cache of this stage's layers for ``n_rows`` rows of ``length`` positions."""
        m = self.model
        return KVCache(m.n_local_layers, n_rows, length, m.n_local_kv_heads, m.config.head_dim,
                       self.gconfig.cache_dtype(m.dtype), m.device)

    def sample(self, out: torch.Tensor, n_generated: int, row_u: Optional[torch.Tensor]) -> torch.Tensor:
        """On the last stage: the packet (``_sample_packet``) of the rows of ``out`` that generated ``n_generated``
        tokens so far (stop tokens banned before ``min_new_tokens``)."""
        banned = self.stop_t if n_generated < self.gconfig.min_new_tokens else None
        return _sample_packet(self.model, out, self.key, self.generator, banned, row_u, self.tp_src)

    def record(self, rows: torch.Tensor, tok: torch.Tensor, lp: torch.Tensor) -> List[int]:
        """``_record`` of one step's samples of the sequences ``rows``: the positions of those that go on."""
        return _record(rows.tolist(), tok.tolist(), lp.tolist(), self.stop, self.tokens, self.logps, self.no_eos)

    def output(self) -> GenerationOutput:
        return GenerationOutput(tokens=self.tokens, logprobs=self.logps, no_eos=self.no_eos)


@torch.no_grad()
@cpu_gemm.with_packed_weights
def generate(
    model: ReaLModel,
    prompts: Sequence[Sequence[int]],
    gconfig: GenerationHyperparameters,
    eos_token_id: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    seeds: Optional[Sequence[int]] = None,
    pipeline_groups: Optional[int] = None,
) -> GenerationOutput:
    """Generate ``gconfig.n`` continuations for every prompt (the n samples of a prompt are adjacent).

    ``seeds`` (one per prompt) make sampling independent of batch composition and layout: sample j of
    prompt i draws from its own generator seeded by ``(seeds[i], j)``.

    ``pipeline_groups`` (only used when ``model.pp > 1``): number G of row groups of the pipelined
    schedule (see the module docstring); default ``pp``, capped at the number of sequences. ``1`` runs
    the sequential schedule. Greedy tokens and ``seeds``-driven samples do not depend on G (log-probs
    agree to rounding); with a shared ``generator`` and no ``seeds``, the random numbers are drawn group
    by group, so with G > 1 a sequence may get a different (equally distributed) sample than with G = 1.
    """
    prompts = [list(p) for p in prompts for _ in range(gconfig.n)]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt and every prompt must be non-empty")
    if pipeline_groups is not None and (not isinstance(pipeline_groups, int) or pipeline_groups < 1):
        raise ValueError(f"pipeline_groups must be a positive integer or None, got {pipeline_groups!r}")
    stop = set(gconfig.stop_token_ids)
    if eos_token_id is not None:
        stop.add(int(eos_token_id))
    # a stop list that bans the whole vocabulary before min_new_tokens leaves nothing to sample (the server's rule)
    check_stop_coverage(sorted(stop), gconfig.min_new_tokens, model.config.vocab_size, "gconfig.")
    if generator is None and gconfig.seed is not None:
        generator = torch.Generator(device=model.device).manual_seed(gconfig.seed)
    B = len(prompts)
    row_seeds = None
    if seeds is not None and not gconfig.greedy:
        if len(seeds) * gconfig.n != B:
            raise ValueError(f"seeds has {len(seeds)} entries for {B // gconfig.n} prompts")
        row_seeds = [int(s) * 1000003 + j for s in seeds for j in range(gconfig.n)]
    run = _Run(model, prompts, gconfig, stop, generator, row_seeds)
    n_groups = min(pipeline_groups or model.pp, B) if model.pp > 1 else 1
    if n_groups > 1:
        return _Pipelined(run, n_groups).generate()
    return _Sequential(run).generate()


# ---------------------------------------------------------------------------- sequential schedule


class _Sequential:
    """The sequential schedule (module docstring), driving the decode core: the whole batch goes through the stages
    at every step; the last stage samples and shares the tokens with every other stage."""

    def __init__(self, run: _Run):
        self.run = run
        model, g = run.model, run.gconfig
        self.comm = None
        forward = None
        if model.pp > 1:
            from realhf.impl.model.parallelism.pipeline import StageComm

            grid = model.grid
            self.comm = StageComm(grid, model.config.hidden_dim, model.dtype, model.device)
            self.last_stage_rank = grid.global_rank_of(model.pp - 1, grid.dp_rank, grid.tp_rank)
            forward = self._stage_forward
        self.streams = RowStreams(run.row_seeds) if run.row_seeds is not None and model.is_last else None
        self.core = Decoder.choose(model, g.compile_decode, g.cuda_graph, forward=forward)

    def _stage_forward(self, x: Optional[torch.Tensor], inp: PackedInput, n_tokens: int) -> torch.Tensor:
        """This pipeline stage's forward: the input from the stage before (but on the first), the output to the next."""
        model = self.run.model
        if not model.is_first:
            x = self.comm.recv_forward(n_tokens)
        y = model(x, inp)
        if not model.is_last:
            self.comm.send_forward(y, blocking=True)
        return y

    def pick(self, out: torch.Tensor, n_generated: int, alive: torch.Tensor):
        """On the last stage: sample from the head output; then share tokens with every rank."""
        model = self.run.model
        if model.is_last:
            u = self.streams.uniforms(alive, n_generated) if self.streams is not None else None
            packed = self.run.sample(out, n_generated, u)
        else:
            packed = torch.empty(alive.numel(), 2, dtype=torch.float64, device=model.device)
        if model.pp > 1:
            dist.broadcast(packed, src=self.last_stage_rank, group=model.grid.pp_group)
        return packed[:, 0].long(), packed[:, 1]

    def prefill(self):
        """Each distinct prompt once; its n samples then share copies of its cache rows (or one shared prefix) and
        sample from the same last-token logits. Returns the cache to decode with and the first (alive, tok, lp)."""
        run, model, g = self.run, self.run.model, self.run.gconfig
        B = len(run.prompts)
        shared = _share_prefixes(model, run.prompts, g, self.core.fast is not None)
        # a shared-prefix cache keeps the prompts apart from the generated positions: the prefill's holds prompts only
        cache = run.cache(B // g.n, max(len(p) for p in run.prompts) + 1 if shared else run.max_len)
        firsts, counts = _distinct_rows(range(B), g.n)
        out = self.core.prefill([run.prompts[i] for i in firsts], cache)
        copies = torch.tensor(counts, dtype=torch.long, device=model.device)
        cache = _expand_prefill(cache, copies, g.max_new_tokens if shared else None)
        if model.is_last:
            out = out.repeat_interleave(copies, dim=0)
        alive = torch.arange(B, device=model.device)  # original index of each cache row
        return (cache, alive) + self.pick(out, 0, alive)

    def generate(self) -> GenerationOutput:
        run, g, core = self.run, self.run.gconfig, self.core
        cache, alive, tok, lp = self.prefill()
        # the compiled or graph step can also sample (greedy, or plain sampling with per-row streams), saving a round
        # of per-operation costs a step; top-k/top-p sample eagerly from its logits
        fold = core.can_sample(run.key, self.streams is not None)
        if fold:
            no_ban = torch.zeros(run.model.config.vocab_size, dtype=torch.bool, device=run.model.device)
            ban = no_ban.clone()
            ban[run.stop_t] = True
        # a graph decoder keeps finished rows in the batch while more than half of them still run
        lazy_drop = core.keeps_finished_rows
        n_live = alive.numel()
        for step in range(g.max_new_tokens):
            keep = run.record(alive, tok, lp)
            if step == g.max_new_tokens - 1 or not keep:
                break
            if lazy_drop and 2 * len(keep) > alive.numel():
                if len(keep) < n_live:
                    alive = _mark_finished(keep, alive)
            else:
                alive, tok = _drop_finished(cache, keep, alive, tok)
            n_live = len(keep)
            if fold:
                u = self.streams.uniforms(alive, step + 1) if self.streams is not None else None
                r = core.step_sample(tok, cache, run.key, ban if step + 1 < g.min_new_tokens else no_ban, u)
                if r is not None:
                    tok, lp = r
                    continue
                fold = False
            tok, lp = self.pick(core.step(tok, cache), step + 1, alive)
        if self.comm is not None:
            self.comm.flush()
        return run.output()


# ---------------------------------------------------------------------------- pipelined schedule


class _StageLinks:
    """The point-to-point messages of the pipelined schedule, for one rank.

    Sends are non-blocking and return their ``(work, buffer)`` pairs: the caller keeps them (a buffer must
    live until its send completes) and waits for them with ``_wait_sends`` (see ``run_item`` for when that
    is safe). Receives are blocking and allocate their buffer from the size the caller knows from the
    shared bookkeeping.
    """

    def __init__(self, model: ReaLModel):
        grid = model.grid
        self.prev = grid.stage_neighbor(-1)  # None on the first stage
        self.next = grid.stage_neighbor(+1)  # None on the last stage
        self.last = grid.global_rank_of(model.pp - 1, grid.dp_rank, grid.tp_rank)
        # where the last stage sends packets: every other stage of this (dp, tp) coordinate
        self.others = [grid.global_rank_of(s, grid.dp_rank, grid.tp_rank) for s in range(model.pp - 1)]
        self.hidden = model.config.hidden_dim
        self.dtype = model.dtype
        self.device = model.device

    def send_activation(self, y: torch.Tensor) -> List[tuple]:
        y = y.detach().contiguous()
        return [(dist.isend(y, dst=self.next, tag=_ACT_TAG), y)]

    def recv_activation(self, n_tokens: int) -> torch.Tensor:
        x = torch.empty(n_tokens, self.hidden, dtype=self.dtype, device=self.device)
        dist.recv(x, src=self.prev, tag=_ACT_TAG)
        return x

    def send_packet(self, packet: torch.Tensor) -> List[tuple]:
        # the same read-only buffer goes to every other stage
        return [(dist.isend(packet, dst=dst, tag=_TOK_TAG), packet) for dst in self.others]

    def recv_packet(self, n_rows: int) -> torch.Tensor:
        packet = torch.empty(n_rows, 2, dtype=torch.float64, device=self.device)
        dist.recv(packet, src=self.last, tag=_TOK_TAG)
        return packet


def _wait_sends(sends: List[tuple]):
    for work, _ in sends:
        work.wait()
    sends.clear()


@dataclasses.dataclass
class _Group:
    """Bookkeeping of one row group; identical on every rank of the replica (except ``packet``)."""

    rows: List[int]  # original indices of the group's sequences
    cache: Optional[KVCache]  # this stage's layers only; dropped once the group is finished
    alive: torch.Tensor  # original index of each cache row (the group's unfinished sequences)
    tok: Optional[torch.Tensor] = None  # last token of each alive row: the input of the next step
    packet: Optional[torch.Tensor] = None  # last stage: packet of the item it ran last for this group
    sends: List[tuple] = dataclasses.field(default_factory=list)  # (work, buffer) of its last item's sends
    done: bool = False
    streams: Optional[RowStreams] = None  # last stage with per-sequence seeds: the random streams of ``rows``


def split_rows(n_rows: int, n_groups: int) -> List[List[int]]:
    """Contiguous, as even as possible groups of ``range(n_rows)`` (earlier groups take the remainder)."""
    return [list(range(*even_range(n_rows, n_groups, g))) for g in range(n_groups)]


class _Pipelined:
    """The pipelined schedule of the module docstring (pp > 1, ``n_groups`` > 1)."""

    def __init__(self, run: _Run, n_groups: int):
        self.run = run
        model, g = run.model, run.gconfig
        device = model.device
        self.links = _StageLinks(model)
        n = g.n
        shared = _share_prefixes(model, run.prompts, g, compiled=False)
        self.shared_max_new = g.max_new_tokens if shared else None
        prefill_len = max(len(p) for p in run.prompts) + 1 if shared else run.max_len
        rs = run.row_seeds
        self.groups = [
            _Group(rows=rows, alive=torch.tensor(rows, dtype=torch.long, device=device),
                   # sized for the group's distinct prompts: the prefill fills one row each, then copies them
                   cache=run.cache(len({i // n for i in rows}), prefill_len),
                   streams=RowStreams([rs[i] for i in rows]) if rs is not None and model.is_last else None)
            for rows in split_rows(len(run.prompts), n_groups)
        ]

    def run_item(self, grp: _Group, x_first: Optional[torch.Tensor], inp: PackedInput, n_tokens: int,
                 n_generated: int, copies: Optional[torch.Tensor] = None):
        """This stage's part of one work item; the last stage also samples and sends the packet. ``copies``
        (prefill): how many rows each prefilled prompt stands for; its head output is repeated to match."""
        model, links = self.run.model, self.links
        x = x_first if model.is_first else links.recv_activation(n_tokens)
        y = model(x, inp)
        if copies is not None and model.is_last:
            y = y.repeat_interleave(copies, dim=0)
        # The sends of this group's previous item (g, r-1) have all been received by now, so waiting for
        # them depends on the transport only: a stage s < last runs (g, r) after consuming packet (g, r-1),
        # which the last stage made after stage s+1 had received activation (g, r-1); the last stage has
        # just received activation (g, r), which stage 0..last-1 sent after consuming packet (g, r-1).
        # So each group has at most one item's sends in flight.
        _wait_sends(grp.sends)
        if not model.is_last:
            grp.sends = links.send_activation(y)
            return
        u = grp.streams.uniforms(grp.alive - grp.rows[0], n_generated) if grp.streams is not None else None
        grp.packet = self.run.sample(y, n_generated, u)
        grp.sends = links.send_packet(grp.packet)

    def prefill(self, grp: _Group):
        # the samples of a prompt are adjacent rows: prefill each distinct prompt of the group once, then
        # copy its cache row for each of its samples in the group (as the sequential schedule does)
        model = self.run.model
        inp, ids, copies = _prefill_input(self.run.prompts, grp.rows, self.run.gconfig.n, grp.cache, model.device)
        # the forward stores the prompt keys/values
        self.run_item(grp, ids if model.is_first else None, inp, ids.numel(), 0, copies)
        grp.cache = _end_prefill(grp.cache, copies, self.shared_max_new)

    def decode(self, grp: _Group, n_generated: int):
        model = self.run.model
        self.run_item(grp, grp.tok if model.is_first else None, decode_input(grp.cache, model.device),
                      grp.alive.numel(), n_generated)
        grp.cache.advance()

    def consume(self, grp: _Group, step: int):
        """Apply the packet of the group's item ``step``: record the tokens, drop finished rows, and
        finish the group when no row is left or this was the last allowed token."""
        if self.run.model.is_last:
            packet, grp.packet = grp.packet, None
        else:
            packet = self.links.recv_packet(grp.alive.numel())
        tok = packet[:, 0].long()
        keep = self.run.record(grp.alive, tok, packet[:, 1])
        if step == self.run.gconfig.max_new_tokens - 1 or not keep:
            grp.done, grp.cache, grp.tok = True, None, None  # free the cache now
            return
        grp.alive, grp.tok = _drop_finished(grp.cache, keep, grp.alive, tok)

    def generate(self) -> GenerationOutput:
        # Every rank walks the same item sequence; a group leaves it on every rank at the same point
        # (``consume`` decides from the packet, which every rank of the replica sees).
        groups = self.groups
        r = 0
        while not all(g.done for g in groups):
            for grp in groups:
                if grp.done:
                    continue
                if r == 0:
                    self.prefill(grp)
                    continue
                self.consume(grp, r - 1)  # its tokens after r steps; stage 0 feeds them to item (g, r)
                if not grp.done:
                    self.decode(grp, r)
            r += 1
        for grp in groups:  # the last sends of every group (all received: every packet has been consumed)
            _wait_sends(grp.sends)
        return self.run.output()
