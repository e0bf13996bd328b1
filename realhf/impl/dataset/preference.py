"""Preference pairs for reward modelling (``rw``) and DPO (``dpo``): JSONL rows ``{"prompt", "chosen", "rejected"}``.

Rows are read by :func:`~realhf.impl.dataset.jsonl.read_jsonl` (the same checks and ``FILE:LINE`` messages as every
other dataset), and a pair whose two answers are the same text is refused: it states no preference.
:func:`validate_preference_jsonl` runs every check on a whole file before any worker starts.

A sample is one pair: two sequences, ``prompt + chosen + [eos]`` then ``prompt + rejected + [eos]`` (the prompt
tokenized with the tokenizer's special tokens, e.g. a BOS, the answers without; with ``use_chat_template`` the prompt
is a user turn of the chat template followed by the assistant header, as ``ppo-math`` prompts are), each truncated
to ``max_seqlen``. ``collate`` packs them as ``packed_input_ids`` and ``prompt_mask`` with two sequences per sample
(chosen first), so a micro-batch never separates a pair.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Iterator, List, Sequence, Tuple

from realhf.base import logging
from realhf.impl.dataset.jsonl import (DatasetError, RowDataset, TypeSpec, _encode, _eos_id, _warn_dropped, encode_prompts,
                                       read_jsonl, register_dataset)

if TYPE_CHECKING:
    from realhf.api.core.data_api import SequenceSample

logger = logging.getLogger(__name__)

PREFERENCE_REQUIRED: Dict[str, TypeSpec] = {"prompt": str, "chosen": str, "rejected": str}
PREFERENCE_OPTIONAL: Dict[str, TypeSpec] = {"id": (str, int)}
_NONEMPTY = ("prompt", "chosen", "rejected")
_DESCRIBE = ("the string fields 'prompt', 'chosen' (the preferred answer) and 'rejected' (the other answer); "
             "optional 'id' (string or integer)")


def read_preference_rows(path: str) -> Iterator[Tuple[int, dict]]:
    """``(line_no, row)`` of every pair of ``path``; DatasetError naming ``FILE:LINE`` for a bad row."""
    for line_no, row in read_jsonl(path, PREFERENCE_REQUIRED, PREFERENCE_OPTIONAL, nonempty=_NONEMPTY,
                                   describe=_DESCRIBE):
        if row["chosen"] == row["rejected"]:
            raise DatasetError(f"{path}:{line_no}: 'chosen' and 'rejected' are the same text, which states no "
                               "preference; each row needs two different answers to its prompt")
        yield line_no, row


def validate_preference_jsonl(path: str) -> int:
    """Check every row of ``path`` (see :func:`read_preference_rows`); returns the number of pairs."""
    return sum(1 for _ in read_preference_rows(path))


class PreferenceDataset(RowDataset):
    """Preference pairs (see the module docstring). A sample's id is its ``id`` field, else its 0-based row index,
    as str. Rows whose prompt alone fills ``max_seqlen`` (no answer token left), or whose two answers differ only
    after ``max_seqlen`` tokens, are skipped with a warning (``skipped``)."""

    def __init__(self, path: str, tokenizer, max_seqlen: int, use_chat_template: bool = False):
        if max_seqlen < 2:
            raise ValueError(f"max_seqlen must be >= 2, got {max_seqlen}")
        self._check_chat_template(tokenizer, path, use_chat_template, "dataset.use_chat_template")
        rows = list(read_preference_rows(path))
        eos = _eos_id(tokenizer)
        prompts = encode_prompts(tokenizer, [r["prompt"] for _, r in rows], use_chat_template)
        chosen = _encode(tokenizer, [r["chosen"] for _, r in rows], False)
        rejected = _encode(tokenizer, [r["rejected"] for _, r in rows], False)
        self.items: List[dict] = []
        too_long, same, seen = [], [], {}
        for idx, ((line_no, row), p, c, r) in enumerate(zip(rows, prompts, chosen, rejected)):
            rid = self._row_id(path, line_no, row, "id", idx, seen)
            if len(p) >= max_seqlen:
                too_long.append(line_no)
                continue
            c_ids, r_ids = (p + c + [eos])[:max_seqlen], (p + r + [eos])[:max_seqlen]
            if c_ids == r_ids:
                same.append(line_no)
                continue
            self.items.append({"id": rid, "chosen_ids": c_ids, "rejected_ids": r_ids, "prompt_len": len(p)})
        notes = [_warn_dropped(path, f"whose prompt has >= max_seqlen={max_seqlen} tokens", too_long, len(rows),
                               "dataset.max_seqlen"),
                 _warn_dropped(path, f"whose answers differ only after max_seqlen={max_seqlen} tokens", same, len(rows),
                               "dataset.max_seqlen")]
        self.skipped = "; ".join(n for n in notes if n) or None  # rows left out, for the run's warnings
        if not self.items:
            raise DatasetError(f"{path}: no pair is left to train on (every prompt has >= max_seqlen={max_seqlen} "
                               "tokens, or the answers differ only after them); raise dataset.max_seqlen")
        logger.info("Loaded %d preference pairs from %s", len(self.items), path)

    @staticmethod
    def collate(items: Sequence[dict]) -> SequenceSample:
        RowDataset._empty_check(items)
        import torch

        from realhf.api.core.data_api import SequenceSample

        ids, mask, lens = [], [], []
        for it in items:
            pair = []
            for seq in (it["chosen_ids"], it["rejected_ids"]):
                ids += seq
                mask += [True] * it["prompt_len"] + [False] * (len(seq) - it["prompt_len"])
                pair.append(len(seq))
            lens.append(pair)
        keys = ("packed_input_ids", "prompt_mask")
        return SequenceSample(
            keys=set(keys), ids=[it["id"] for it in items], seqlens={k: [list(p) for p in lens] for k in keys},
            trailing_shapes={k: () for k in keys}, dtypes={"packed_input_ids": torch.int64, "prompt_mask": torch.bool},
            data={"packed_input_ids": torch.tensor(ids, dtype=torch.int64),
                  "prompt_mask": torch.tensor(mask, dtype=torch.bool)})


register_dataset("preference", PreferenceDataset)


def preference_rows_from_math(problems: Sequence[dict], seed: int = 1, max_offset: int = 3) -> List[dict]:
    """Synthetic pairs from math rows ``{query_id, prompt, solutions}`` with integer answers (e.g.
    :func:`~realhf.impl.dataset.arithmetic.make_arithmetic_problems`): ``chosen`` is the right answer, ``rejected`` a
    wrong one, off by 1 to ``max_offset`` either way (never negative). The same arguments give the same rows."""
    import random

    rng = random.Random(seed)
    out = []
    for p in problems:
        right = int(p["solutions"][0])
        wrong = right
        while wrong == right or wrong < 0:
            wrong = right + rng.choice([-1, 1]) * rng.randint(1, max_offset)
        out.append({"id": str(p["query_id"]), "prompt": p["prompt"], "chosen": str(right), "rejected": str(wrong)})
    return out
