"""The generation contract: what everything that generates takes and returns.

One set of sampling parameters (:class:`SamplingParams`), one request (:class:`GenerateRequest`), one result
(:class:`GenerateResult` of :class:`SampleOutput` s, each with the weight version behind every token), one error
(:class:`RequestError`), shared by in-process generation (``realhf.impl.model.nn.generation``), the generation
servers and their client (``realhf.gen_server``), the rollout workflows (``realhf.impl.workflow``), evaluation
(``evaluation/``) and the experiments' configs (``gen``, ``ppo.gen``: these sections *are*
:class:`GenerationHyperparameters`). The rule of what can be sampled is :mod:`realhf.api.core.sampling_checks`.

Two classes, one set of fields:

* :class:`SamplingParams` holds what is sampled. It is a request as a client builds it: nothing is checked when it
  is made (a server must be able to receive, and refuse, what cannot be sampled); :meth:`SamplingParams.validate`
  applies the rule where a request is admitted (a :class:`RequestError` naming ``sampling.<field>``). Its
  :meth:`~SamplingParams.to_dict` / :meth:`~SamplingParams.from_dict` are the wire format.
* :class:`GenerationHyperparameters` is the same sampling parameters plus how an in-process ``generate`` call
  decodes (``compile_decode``, ``cuda_graph``, ``kv_cache_dtype``), checked when built (the options of an
  experiment fail at config time). The decode options are not part of a request: a server decodes as its own
  backend options say (``gen_server.extra``), once for every request, and refuses them per request.

Conventions every generator keeps:

* Token ids in, token ids out; no text. The ``n`` samples of a request are sample ``j = 0..n-1``; with a
  ``seed`` sample ``j`` draws from the random stream seeded by :func:`sample_seed` ``(seed, j)``, so a seed gives
  the same samples whatever else runs at the same time.
* Log-probs are those of the sampled token under ``log_softmax(logits / temperature)`` (temperature 1 for
  greedy), before top-k/top-p truncation: the quantity a training forward pass computes.
* ``versions[i]`` is the weight version that produced output token ``i`` (a weight update may land while a
  request runs: later tokens then carry the new version).
"""
import dataclasses
from typing import Any, Dict, List, Optional

from realhf.api.core.sampling_checks import MIN_TEMPERATURE, SamplingValueError, check_sampling  # noqa: F401

FINISH_REASONS = ("stop", "length", "abort")

# the KV cache dtypes generation takes (GenerationHyperparameters.kv_cache_dtype, the gen server's backend option)
KV_CACHE_DTYPES = ("auto", "float16")


def sample_seed(seed: int, j: int) -> int:
    """Seed of sample ``j`` of a request with ``seed`` (as ``generate(seeds=...)`` derives its row seeds)."""
    return int(seed) * 1000003 + int(j)


class RequestError(ValueError):
    """A request that is malformed or cannot be served (a server answers 400 with this message)."""


def check_kv_cache_dtype(name: str, what: str = "kv_cache_dtype") -> None:
    """Refuse a KV cache dtype outside :data:`KV_CACHE_DTYPES`; the message begins with ``what``."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"{what} must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")


def kv_cache_torch_dtype(name: str, model_dtype):
    """The torch dtype of a KV cache named ``name`` ("auto": the model's) for a model of ``model_dtype``."""
    import torch

    return model_dtype if name == "auto" else getattr(torch, name)


def _opt(default=dataclasses.MISSING, help: str = "", factory=dataclasses.MISSING):
    """A field with its ``--help`` text (the experiments' config sections are these classes)."""
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def _ints_like(ids):
    """``ids`` with int elements, in the container it came in (a config's list stays a list)."""
    return tuple(int(t) for t in ids) if isinstance(ids, tuple) else [int(t) for t in ids]


@dataclasses.dataclass
class SamplingParams:
    """What is sampled, for one prompt: ``n`` samples of at most ``max_new_tokens`` tokens each."""

    n: int = _opt(1, "samples per prompt")
    greedy: bool = _opt(False, "greedy decoding instead of sampling")
    temperature: float = _opt(1.0, f"sampling temperature, >= {MIN_TEMPERATURE:g} unless greedy (smaller ones overflow "
                                   "the scaled logits in fp32; far below 1e-4 sampling is greedy in all but name)")
    top_p: float = _opt(1.0, "nucleus sampling probability mass, in (0, 1]")
    top_k: int = _opt(0, "sample among the k most likely tokens (0 = no limit)")
    min_new_tokens: int = _opt(0, "minimum generated tokens before EOS may be sampled")
    max_new_tokens: int = _opt(256, "maximum generated tokens per answer")
    stop_token_ids: List[int] = _opt(help="extra token ids that end an answer (EOS always does)", factory=list)
    seed: Optional[int] = _opt(None, "sampling seed, from which each sample's random stream derives (null = in an "
                                     "experiment, derived from the experiment seed; in a request, the server's own "
                                     "random stream)")

    def check(self, prefix: str = "") -> "SamplingParams":
        """Refuse what cannot be sampled (:func:`~realhf.api.core.sampling_checks.check_sampling`): a
        ``SamplingValueError`` names ``prefix`` + the field, the value and what is allowed."""
        check_sampling(self, prefix=prefix)
        return self

    def validate(self) -> "SamplingParams":
        """A request's admission: refuse what cannot be sampled, by the rule in-process generation options follow
        too; a ``RequestError`` names ``sampling.<field>``, the value and what is allowed. A server also refuses, at
        admission, a stop list that covers its whole vocabulary while ``min_new_tokens`` > 0
        (``check_stop_coverage``)."""
        try:
            self.check(prefix="sampling.")
        except SamplingValueError as e:
            raise RequestError(str(e)) from None
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        return self

    @classmethod
    def request_fields(cls) -> List[str]:
        """The names a request carries (the decode options of :class:`GenerationHyperparameters` are not sent)."""
        return [f.name for f in dataclasses.fields(SamplingParams)]

    @classmethod
    def from_dict(cls, d: Optional[Dict[str, Any]]) -> "SamplingParams":
        """The sampling of a request body, validated; unknown keys are refused."""
        d = dict(d or {})
        names = SamplingParams.request_fields()
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise RequestError(f"unknown sampling keys {unknown}; allowed: {sorted(names)}")
        return SamplingParams(**d).validate()

    def to_dict(self) -> Dict[str, Any]:
        """The wire format: the request's fields (stop ids as a list)."""
        d = {k: getattr(self, k) for k in SamplingParams.request_fields()}
        d["stop_token_ids"] = list(d["stop_token_ids"])
        return d


@dataclasses.dataclass
class GenerationHyperparameters(SamplingParams):
    """The options of an in-process generation (``generate``, the generating interfaces) and the experiments'
    sampling sections: the sampling parameters, checked when built (the rule a server applies to each request),
    and how the decode step runs."""

    compile_decode: bool = _opt(
        False, "compile the decode step with torch.compile (single-stage tp=1 generation; faster for small "
        "models, at a compile cost of seconds to minutes once per run)")
    cuda_graph: bool = _opt(
        True, "on CUDA, replay the decode step as a CUDA graph (single-stage tp=1 generation; the step's ~1,000 kernel "
        "launches become one); ignored on CPU and under compile_decode")
    kv_cache_dtype: str = _opt(
        "auto", "the KV cache's dtype: auto (the model's) or float16 (an fp32 model on CPU reads half the bytes in "
        "attention over the cache; log-probs then differ from an fp32 forward by fp16 rounding, about 1e-3)")

    def __post_init__(self):
        check_kv_cache_dtype(self.kv_cache_dtype)
        self.check()  # the same rule as a generation server's requests
        self.stop_token_ids = _ints_like(self.stop_token_ids)

    def cache_dtype(self, model_dtype):
        """The KV cache's torch dtype for a model of ``model_dtype``."""
        return kv_cache_torch_dtype(self.kv_cache_dtype, model_dtype)

    def to_hyperparameters(self, n: Optional[int] = None) -> "GenerationHyperparameters":
        """The engine's options: a copy (with ``n`` samples per prompt when given; stop ids as a tuple)."""
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(GenerationHyperparameters)}
        kw["stop_token_ids"] = tuple(self.stop_token_ids)
        if n is not None:
            kw["n"] = n
        return GenerationHyperparameters(**kw)

    def sampling(self, **changes) -> SamplingParams:
        """The request part of these options (with ``changes``, e.g. a request's own stop list and seed)."""
        kw = {k: getattr(self, k) for k in SamplingParams.request_fields()}
        kw["stop_token_ids"] = list(kw["stop_token_ids"])
        kw.update(changes)
        return SamplingParams(**kw)


def _int_list(v: Any, what: str) -> List[int]:
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise RequestError(f"{what} must be a list of integers")
    return [int(x) for x in v]


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
