"""The size of one chunk of output-head logits: the output head and its log-softmax run over at most this many bytes
of fp32 logits at a time (``realhf.impl.model.nn.chunked_head``), and the memory model counts the same chunk
(``realhf.plan.memory``). ``REALHF_LOGITS_CHUNK_MB`` overrides the default of 1 GiB."""
import os
from typing import Optional

CHUNK_BYTES = 1 << 30
CHUNK_ENV = "REALHF_LOGITS_CHUNK_MB"


def chunk_bytes() -> int:
    """The fp32 bytes of one chunk of logits (``REALHF_LOGITS_CHUNK_MB`` or :data:`CHUNK_BYTES`)."""
    v = os.environ.get(CHUNK_ENV)
    if not v:
        return CHUNK_BYTES
    try:
        mb = float(v)
    except ValueError:
        raise ValueError(f"{CHUNK_ENV}={v!r}: expected a positive number of MiB") from None
    if not mb > 0:
        raise ValueError(f"{CHUNK_ENV}={v!r}: expected a positive number of MiB")
    return max(1, int(mb * (1 << 20)))


def chunk_rows(vocab_local: int, budget_bytes: Optional[int] = None) -> int:
    """Tokens per chunk of the output head for ``vocab_local`` outputs on a rank: as many as fit ``budget_bytes`` of
    fp32 logits (default :func:`chunk_bytes`), at least 1."""
    b = chunk_bytes() if budget_bytes is None else budget_bytes
    return max(1, b // (4 * max(1, vocab_local)))
