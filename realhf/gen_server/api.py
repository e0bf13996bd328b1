"""The generation-server interface: what every engine implements, and how weights reach it.

A *generation server* is one process per data-parallel replica of the generation layout (its tensor/pipeline
ranks inside it) that serves HTTP/JSON (``realhf.gen_server.server``). Behind the HTTP layer sits one
:class:`GenerationEngine` of a backend (``gen``: realhf's own ReaLModel engine; ``vllm``: vLLM). SGLang is
not wrapped: it is a server of its own, spoken to in its native endpoints by the client
(``realhf.gen_server.sglang``).

What a request and a result hold (:class:`SamplingParams`, :class:`GenerateRequest`, :class:`GenerateResult`,
:class:`SampleOutput` with the weight version behind every token, :class:`RequestError`) is the generation
contract of ``realhf.api.core.generation``, with the conventions every engine keeps (token ids in and out, a
sample's random stream from :func:`sample_seed`, log-probs before truncation, per-token versions); it is
re-exported here. Weight updates take Hugging Face tensor names and layouts (``model.embed_tokens.weight`` ...):
from an HF folder on disk, as named tensors broadcast over a torch.distributed group the trainer joins
(:mod:`realhf.gen_server.weight_group`), or, on the trainer's host, as tensors it shares by reference (CUDA IPC
handles, a shared-memory file on CPU: :mod:`realhf.gen_server.weight_share`).
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Dict, List, Optional, Sequence

from realhf.api.core.generation import (  # noqa: F401 (the generation contract, re-exported for the engines)
    FINISH_REASONS,
    GenerateRequest,
    GenerateResult,
    RequestError,
    SampleOutput,
    SamplingParams,
    sample_seed,
)


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

    shared_weights: bool = False  # whether update_weights_from_shared is implemented

    async def update_weights_from_shared(self, parts: List[dict], version: int) -> None:
        """Load tensors the trainer shares on this host (:mod:`realhf.gen_server.weight_share`: CUDA IPC handles, or
        a shared-memory file on CPU), one part per sharing trainer rank."""
        raise RequestError(f"the {self.backend} engine does not take shared weights; "
                           "use gen_server.weight_transport=group")

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
