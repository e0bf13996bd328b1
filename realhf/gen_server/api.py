"""The generation-server interface: what a request and a result hold, and what every engine implements.

A *generation server* is one process per data-parallel replica of the generation layout (its tensor/pipeline
ranks inside it) that serves HTTP/JSON (``realhf.gen_server.server``). Behind the HTTP layer sits one
:class:`GenerationEngine` of a backend (``gen``: realhf's own ReaLModel engine; ``vllm``: vLLM). SGLang is
not wrapped: it is a server of its own, spoken to in its native endpoints by the client
(``realhf.gen_server.sglang``).

Conventions every engine keeps:

* Token ids in, token ids out; no text. The ``n`` samples of a request are sample ``j = 0..n-1``; with a
  request ``seed`` sample ``j`` draws from the random stream seeded by :func:`sample_seed` ``(seed, j)``
  (the same rule as ``realhf.impl.model.nn.generation.generate(seeds=...)``), so a seed gives the same
  samples whatever else the server runs at the same time.
* Log-probs are those of the sampled token under ``log_softmax(logits / temperature)`` (temperature 1 for
  greedy), before top-k/top-p truncation: the quantity a training forward pass computes.
* ``versions[i]`` is the weight version that produced output token ``i`` (a weight update may land while a
  request runs: later tokens then carry the new version).
* Weight updates take Hugging Face tensor names and layouts (``model.embed_tokens.weight`` ...): from an HF
  folder on disk, or as named tensors broadcast over a torch.distributed group the trainer joins
  (:mod:`realhf.gen_server.weight_group`).
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Dict, List, Optional, Sequence

from realhf.api.core.sampling_checks import SamplingValueError, check_sampling

FINISH_REASONS = ("stop", "length", "abort")


def sample_seed(seed: int, j: int) -> int:
    """Seed of sample ``j`` of a request with ``seed`` (as ``generate(seeds=...)`` derives its row seeds)."""
    return int(seed) * 1000003 + int(j)


class RequestError(ValueError):
    """A request that is malformed or cannot be served (the server answers 400 with this message)."""


def _int_list(v: Any, what: str) -> List[int]:
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise RequestError(f"{what} must be a list of integers")
    return [int(x) for x in v]


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    greedy: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    min_new_tokens: int = 0
    max_new_tokens: int = 256
    stop_token_ids: List[int] = dataclasses.field(default_factory=list)
    seed: Optional[int] = None  # per request; None: the engine's own random stream

    def validate(self) -> "SamplingParams":
        """Refuse what cannot be sampled, by the rule in-process generation options follow too
        (``realhf.api.core.sampling_checks``); a ``RequestError`` names the field, the value and what is allowed.
        A server also refuses, at admission, a stop list that covers its whole vocabulary while
        ``min_new_tokens`` > 0 (``check_stop_coverage``)."""
        try:
            check_sampling(self, prefix="sampling.")
        except SamplingValueError as e:
            raise RequestError(str(e)) from None
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        return self

    @classmethod
    def from_dict(cls, d: Optional[Dict[str, Any]]) -> "SamplingParams":
        d = dict(d or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise RequestError(f"unknown sampling keys {unknown}; allowed: {sorted(names)}")
        return cls(**d).validate()

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class GenerateRequest:
    rid: str
    input_ids: List[int]
    sampling: SamplingParams

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "GenerateRequest":
        if not isinstance(d, dict):
            raise RequestError("the body must be a JSON object")
        rid = d.get("rid")
        if not isinstance(rid, str) or not rid or len(rid) > 200:
            raise RequestError("rid must be a non-empty string of at most 200 characters")
        ids = _int_list(d.get("input_ids"), "input_ids")
        if not ids:
            raise RequestError("input_ids must not be empty")
        return cls(rid=rid, input_ids=ids, sampling=SamplingParams.from_dict(d.get("sampling")))

    def to_dict(self) -> Dict[str, Any]:
        return {"rid": self.rid, "input_ids": list(self.input_ids), "sampling": self.sampling.to_dict()}


@dataclasses.dataclass
class SampleOutput:
    output_ids: List[int]  # generated ids (the stop token included when it ended the sample)
    logprobs: List[float]  # one per output id
    versions: List[int]  # weight version behind each output id
    finish_reason: str  # "stop" | "length" | "abort"

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class GenerateResult:
    rid: str
    outputs: List[SampleOutput]  # n of them, sample j at index j

    def to_dict(self) -> Dict[str, Any]:
        return {"rid": self.rid, "outputs": [o.to_dict() for o in self.outputs]}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "GenerateResult":
        return cls(rid=d["rid"], outputs=[SampleOutput(**o) for o in d["outputs"]])


@dataclasses.dataclass
class TensorMeta:
    """One tensor of an in-memory weight update: its HF name, dtype name (``float32``), shape, and the rank
    of the weight group that broadcasts it (a trainer rank)."""

    name: str
    dtype: str
    shape: List[int]
    src: int = 0


@dataclasses.dataclass
class WeightGroupSpec:
    """The torch.distributed group of an in-memory weight update: ``world_size`` ranks, the trainer's first
    (``0 .. n_senders-1``), then the servers' ranks; this server's ranks start at ``rank_offset``. The group
    meets at the TCP store ``master_addr:master_port`` (hosted by the trainer's rank 0)."""

    master_addr: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str = "gloo"  # "gloo" on CPU, "nccl" on GPU
    timeout_secs: float = 300.0


class GenerationEngine(abc.ABC):
    """One backend's engine inside a generation server. Every method may be called concurrently from the
    server's event loop; ``generate`` calls overlap (continuous batching: a request joins the running batch)."""

    backend: str = ""

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model (raises with the cause when it cannot: bad path, out of memory ...)."""

    @abc.abstractmethod
    async def generate(self, req: GenerateRequest) -> GenerateResult:
        """Run one request to completion (or until aborted: its samples then end with ``"abort"``)."""

    @abc.abstractmethod
    async def abort(self, rids: Optional[Sequence[str]] = None) -> int:
        """Abort the listed requests (None: all running and waiting); returns how many were aborted."""

    @abc.abstractmethod
    async def pause(self) -> None:
        """Stop making progress on requests (they stay in the batch) until ``resume``; new requests wait."""

    @abc.abstractmethod
    async def resume(self) -> None:
        ...

    @abc.abstractmethod
    async def update_weights_from_disk(self, path: str, version: int) -> None:
        """Load the HF folder ``path``; tokens generated after this returns carry ``version``."""

    @abc.abstractmethod
    async def init_weight_group(self, spec: WeightGroupSpec) -> None:
        """Join the weight-update group (collective with the trainer's ``init`` of the same spec)."""

    @abc.abstractmethod
    async def update_weights_from_group(self, tensors: List[TensorMeta], version: int) -> None:
        """Receive ``tensors`` (broadcast by the trainer, in this order) over the weight group and load them."""

    @abc.abstractmethod
    async def logprobs(self, sequences: List[List[int]]) -> List[List[float]]:
        """Log-prob of every token of each sequence after the first, under the current weights
        (``len(seq) - 1`` values each), at temperature 1."""

    @abc.abstractmethod
    def metrics(self) -> Dict[str, Any]:
        """At least: ``running_requests``, ``waiting_requests``, ``tokens_in_flight``, ``version``,
        ``generated_tokens`` (total since start), ``paused``."""

    @property
    @abc.abstractmethod
    def version(self) -> int:
        ...

    async def close(self) -> None:
        """Release the model (the server process exits after this)."""


@dataclasses.dataclass
class EngineConfig:
    """What a server's engine is built from (``realhf.gen_server.make_engine``)."""

    backend: str  # "gen" | "vllm"
    model_path: str  # an HF folder (config.json + safetensors + tokenizer files)
    dtype: str = "float32"  # "float32" | "bfloat16" | "float16"
    device: str = "cpu"  # "cpu" | "cuda"
    tp_size: int = 1  # tensor-parallel ranks inside the server
    max_model_len: int = 2048  # prompt + new tokens of one sample
    max_num_seqs: int = 64  # samples decoded together at most (more wait)
    seed: int = 1  # the engine's own random stream (requests without a seed)
    threads: int = 0  # torch threads (0: leave as is)
    extra: Dict[str, Any] = dataclasses.field(default_factory=dict)  # backend-specific options
