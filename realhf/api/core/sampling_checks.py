"""The one rule for sampling parameters: what can be sampled and what cannot.

Every place that takes sampling parameters (the generation contract, :mod:`realhf.api.core.generation`) applies
it: the in-process generation options (``GenerationHyperparameters``, which the experiments' ``gen`` and ``ppo.gen``
sections are) when they are built, at config time, and a generation server's per-request ``SamplingParams`` when
a request arrives (``SamplingParams.validate``). A value it
refuses fails with :class:`SamplingValueError`, whose message names the field, the value and what is allowed.

What it refuses, and why:

* ``temperature`` below :data:`MIN_TEMPERATURE` (unless ``greedy``), or not finite: the sampler divides the fp32
  logits by the temperature and then subtracts the largest of them, so ``logits / temperature`` and differences of
  two such values must stay finite in fp32 (largest finite value about 3.4e38). Logits of a language model are far
  smaller than 65504 (the largest fp16 number: an fp16 model cannot produce more; bf16 and fp32 models are trained
  to the same scale), so ``2 * 65504 / MIN_TEMPERATURE`` must be below 3.4e38, i.e. ``MIN_TEMPERATURE`` above
  3.9e-34. :data:`MIN_TEMPERATURE` = 1e-30 keeps a margin of over 2000 and is itself a normal fp32 number (a
  temperature such as 1e-40 is not: it rounds to a subnormal or zero, and the division gives inf or NaN). Below
  about 1e-4 sampling is greedy in all but name; ask for ``greedy`` instead.
* Booleans that are not booleans (``greedy: "false"``, ``1``): a string is truthy, so ``"false"`` would mean greedy.
* Integers that are not integers (``n``, ``top_k``, ``min_new_tokens``, ``max_new_tokens``, ``seed``, stop ids).
* A stop list that covers the whole vocabulary while ``min_new_tokens`` > 0 (:func:`check_stop_coverage`, where the
  vocabulary size is known: a server at admission): every token would be banned before ``min_new_tokens``, so
  nothing could be sampled.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

FP32_MAX = 3.4028234663852886e38  # the largest finite fp32 number
LOGIT_BOUND = 65504.0  # a bound on |logit| of any language model (the largest fp16 number)
MIN_TEMPERATURE = 1e-30  # the smallest temperature sampled: 2 * LOGIT_BOUND / MIN_TEMPERATURE < FP32_MAX, with margin

assert 2 * LOGIT_BOUND / MIN_TEMPERATURE < FP32_MAX / 1000, "MIN_TEMPERATURE leaves no margin below fp32 overflow"


class SamplingValueError(ValueError):
    """A sampling parameter outside what can be sampled. ``field``: its name as the caller knows it (with prefix)."""

    def __init__(self, field: str, value: Any, allowed: str):
        self.field = field
        super().__init__(f"{field}={_show(value)} is not allowed; {allowed}")


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)) and len(value) > 8:
        return f"[{', '.join(repr(v) for v in value[:4])}, ... {value[-1]!r}] ({len(value)} ids)"
    return repr(value)


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def check_sampling(p: Any, prefix: str = "") -> None:
    """Refuse sampling parameters that cannot be sampled (see the module docstring). ``p`` holds them as attributes:
    ``n``, ``greedy``, ``temperature``, ``top_p``, ``top_k``, ``min_new_tokens``, ``max_new_tokens``,
    ``stop_token_ids``, ``seed``. ``prefix`` is put before each field name in messages (``"sampling."``)."""

    def bad(name: str, allowed: str):
        raise SamplingValueError(prefix + name, getattr(p, name), allowed)

    if not _is_int(p.n) or p.n < 1:
        bad("n", "expected an integer >= 1")
    if not isinstance(p.greedy, bool):
        bad("greedy", "expected a boolean (true or false)")
    if not _is_int(p.max_new_tokens) or p.max_new_tokens < 1:
        bad("max_new_tokens", "expected an integer >= 1")
    if not _is_int(p.min_new_tokens) or not 0 <= p.min_new_tokens <= p.max_new_tokens:
        bad("min_new_tokens", f"expected an integer in [0, max_new_tokens={p.max_new_tokens}]")
    if not p.greedy and not (_is_number(p.temperature) and p.temperature >= MIN_TEMPERATURE):
        bad("temperature", f"expected a finite number >= {MIN_TEMPERATURE:g} (smaller ones make the scaled logits "
                           "overflow fp32), or greedy=true")
    if not (_is_number(p.top_p) and 0 < p.top_p <= 1):
        bad("top_p", "expected a finite number in (0, 1]")
    if not _is_int(p.top_k) or p.top_k < 0:
        bad("top_k", "expected an integer >= 0 (0: no top-k)")
    stop = p.stop_token_ids
    if not isinstance(stop, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in stop):
        bad("stop_token_ids", "expected a list of token ids (integers >= 0)")
    if p.seed is not None and not _is_int(p.seed):
        bad("seed", "expected an integer or null")


def check_stop_coverage(stop_token_ids: Sequence[int], min_new_tokens: int, vocab_size: int,
                        prefix: str = "") -> None:
    """Refuse a stop list that covers all ``vocab_size`` tokens while ``min_new_tokens`` > 0: every token is banned
    before ``min_new_tokens``, so no token could be sampled."""
    if min_new_tokens > 0 and len({t for t in stop_token_ids if 0 <= t < vocab_size}) >= vocab_size:
        raise SamplingValueError(
            prefix + "stop_token_ids", list(stop_token_ids),
            f"with {prefix}min_new_tokens={min_new_tokens} > 0 the stop tokens are banned until then, and these are "
            f"all {vocab_size} tokens of the vocabulary, so nothing could be sampled; leave at least one token out "
            "of the stop list or set min_new_tokens=0")
