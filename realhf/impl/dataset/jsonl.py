"""JSONL datasets: checked reading, SFT prompt/answer and prompt-only datasets, epoch iteration.

Every row problem (bad JSON, a missing or ill-typed field, an empty prompt) raises
:class:`DatasetError` naming ``file:line``, what is wrong and what is allowed; an empty file is an
error too. :func:`validate_jsonl` scans a whole file so that experiments can check their data before
any worker starts.

Datasets return plain Python items (``__getitem__``) and pack a list of items into a
:class:`~realhf.api.core.data_api.SequenceSample` (``collate``). :class:`EpochIterator` cuts a
dataset into global batches in a deterministic order per epoch and gives each data-parallel rank
its share; its state (epoch, position) resumes exactly.
"""
from __future__ import annotations

import difflib
import json
import os
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from realhf.base import logging

if TYPE_CHECKING:  # torch (2-3 s to import) only where samples are built: the launcher checks rows without it
    from realhf.api.core.data_api import SequenceSample

logger = logging.getLogger(__name__)

TypeSpec = Union[type, Tuple[type, ...]]


class DatasetError(ValueError):
    """A dataset file that cannot be used; the message names ``file:line`` where it applies."""


# ----------------------------------------------------------------------------- reading
def _types(t: TypeSpec) -> Tuple[type, ...]:
    return t if isinstance(t, tuple) else (t,)


def _type_names(t: TypeSpec) -> str:
    names = {str: "string", int: "integer", float: "number", bool: "boolean", list: "list", dict: "object"}
    return " or ".join(names.get(x, x.__name__) for x in _types(t))


def _type_ok(value: Any, t: TypeSpec) -> bool:
    ts = _types(t)
    if isinstance(value, bool) and bool not in ts:
        return False
    if isinstance(value, int) and not isinstance(value, bool) and float in ts:
        return True
    return isinstance(value, ts)


def _describe(required: Dict[str, TypeSpec], optional: Optional[Dict[str, TypeSpec]] = None) -> str:
    req = ", ".join(f"{k!r} ({_type_names(t)})" for k, t in required.items())
    opt = ", ".join(f"{k!r} ({_type_names(t)})" for k, t in (optional or {}).items())
    return f"required fields {req}" + (f"; optional {opt}" if opt else "")


MAX_ROW_BYTES = 4 << 20  # default limit of one JSONL row (4 MiB): far above any prompt a model can take


def _lines(f, path: str, max_row_bytes: int) -> Iterator[Tuple[int, bytes]]:
    """``(line_no, line)`` of a binary file; a line over ``max_row_bytes`` (newline excluded) is a
    DatasetError with its size, found without holding more than ``max_row_bytes`` of it in memory."""
    line_no = 0
    while True:
        raw = f.readline(max_row_bytes + 2)  # room for the row, "\r\n", and one byte to see it is too long
        if not raw:
            return
        line_no += 1
        size = len(raw.rstrip(b"\r\n"))
        if size > max_row_bytes:
            while not raw.endswith(b"\n"):  # measure the rest of the row, a chunk at a time
                raw = f.readline(1 << 20)
                if not raw:
                    break
                size += len(raw.rstrip(b"\r\n"))
            raise DatasetError(f"{path}:{line_no}: the row has {size} bytes, over the limit of {max_row_bytes} bytes "
                               "(max_row_bytes) for one JSONL row; shorten it or remove it")
        yield line_no, raw


def read_jsonl(path: str, required: Dict[str, TypeSpec], optional: Optional[Dict[str, TypeSpec]] = None,
               nonempty: Sequence[str] = ("prompt",), max_row_bytes: int = MAX_ROW_BYTES,
               describe: Optional[str] = None) -> Iterator[Tuple[int, dict]]:
    """Yield ``(line_no, row)`` for every non-blank line of ``path`` (1-based line numbers).

    ``required`` / ``optional`` map field names to a type or tuple of types (``bool`` is never
    taken for an ``int``; an ``int`` is accepted for ``float``); an optional field set to null
    counts as absent. String fields named in ``nonempty`` must not be blank. A row longer than
    ``max_row_bytes`` is rejected by its size before it is parsed; text that is not valid Unicode
    (a lone surrogate from a JSON escape such as ``"\\ud800"``) is rejected with its field.
    ``describe`` says in words what a row holds, for the messages (default: the fields listed).
    """
    if not os.path.isfile(path):
        raise DatasetError(f"{path}: no such file")
    if max_row_bytes < 1:
        raise ValueError(f"max_row_bytes must be >= 1, got {max_row_bytes}")
    optional = optional or {}
    shape = describe or _describe(required, optional)
    n = last = 0
    with open(path, "rb") as f:
        for line_no, raw in _lines(f, path, max_row_bytes):
            last = line_no
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(
                    f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line must be one JSON object "
                    f"with {shape}"
                ) from None
            if not isinstance(row, dict):
                got = "null" if row is None else _type_names(type(row))
                raise DatasetError(f"{where}: expected a JSON object, got {got}; each line needs {shape}")
            bad = _not_unicode(row) if "\\u" in line else None  # lone surrogates come only from \u escapes
            if bad is not None:
                raise DatasetError(f"{where}: {bad} holds a lone surrogate (a \\ud800-\\udfff escape that is not half "
                                   "of a pair), which is not Unicode text; write the character itself or a valid pair")
            for key, t in required.items():
                if key not in row:
                    raise DatasetError(f"{where}: missing field {key!r}; each row needs {shape}")
                if not _type_ok(row[key], t):
                    raise DatasetError(f"{where}: field {key!r} must be a {_type_names(t)}, got "
                                       f"{type(row[key]).__name__} {_short(row[key])}")
            for key, t in optional.items():
                if row.get(key) is not None and not _type_ok(row[key], t):
                    raise DatasetError(f"{where}: field {key!r} must be a {_type_names(t)} (or absent), got "
                                       f"{type(row[key]).__name__} {_short(row[key])}")
            for key in nonempty:
                v = row.get(key)
                if isinstance(v, str) and not v.strip():
                    raise DatasetError(f"{where}: field {key!r} is empty; it must be a non-empty string")
            n += 1
            yield line_no, row
    if n == 0:
        raise DatasetError(f"{path}:{max(last, 1)}: no rows, {os.path.basename(path)} is empty; expected one JSON "
                           f"object per line with {shape}")


def _not_unicode(value: Any, where: str = "") -> Optional[str]:
    """Where in a parsed row (e.g. ``field 'prompt'``, ``field 'solutions'[1]``, ``a field name``) text cannot be
    encoded as UTF-8, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            if _not_unicode(k) is not None:
                return f"a field name ({k.encode('utf-8', 'backslashreplace').decode()})"
            found = _not_unicode(v, f"{where}[{k!r}]" if where else f"field {k!r}")
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _not_unicode(v, f"{where}[{i}]")
            if found is not None:
                return found
    return None


def _short(v: Any, n: int = 60) -> str:
    s = json.dumps(v, ensure_ascii=False) if not isinstance(v, str) else repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."


def validate_jsonl(path: str, required: Dict[str, TypeSpec], optional: Optional[Dict[str, TypeSpec]] = None,
                   nonempty: Sequence[str] = ("prompt",), max_row_bytes: int = MAX_ROW_BYTES) -> int:
    """Check every row of ``path`` (see :func:`read_jsonl`); returns the number of rows. A data file standing in
    for another cluster's (``realhf.api.quickstart.stand_ins``) counts as ``STAND_IN_ROWS`` rows."""
    from realhf.api.quickstart import stand_ins

    if stand_ins.is_stand_in(path):
        return stand_ins.STAND_IN_ROWS
    return sum(1 for _ in read_jsonl(path, required, optional, nonempty, max_row_bytes))


def _eos_id(tokenizer) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise DatasetError("the tokenizer has no eos token (eos_token_id is None); set one in tokenizer_config.json")
    return int(eos)


def _encode(tokenizer, texts: List[str], add_special_tokens: bool) -> List[List[int]]:
    if not texts:
        return []
    return [list(map(int, ids)) for ids in tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]


def _warn_dropped(path: str, what: str, lines: List[int], total: int, key: str) -> Optional[str]:
    """Log (and return, for the datasets' ``skipped`` note) which rows were left out, or None when none was;
    ``key`` is the option that decides it."""
    if not lines:
        return None
    shown = ", ".join(map(str, lines[:5])) + (", ..." if len(lines) > 5 else "")
    msg = f"{path}: skipped {len(lines)} of {total} rows {what} (lines {shown}); raise {key} to use them"
    logger.warning(msg)
    return msg


# ----------------------------------------------------------------------------- shared by the row datasets
class RowDataset:
    """What every JSONL dataset here shares: its samples in ``items`` (one dict per kept row, with an ``"id"``),
    ids unique across the file, prompts through the tokenizer's chat template when asked."""

    items: List[dict]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]

    @staticmethod
    def _row_id(path: str, line_no: int, row: dict, key: str, idx: int, seen: Dict[str, int]) -> str:
        """The row's ``key`` field as str, else its 0-based index; refused when an earlier row has the same id."""
        rid = str(row[key]) if row.get(key) is not None else str(idx)
        if rid in seen:
            raise DatasetError(f"{path}:{line_no}: {key} {rid!r} repeats the one on line {seen[rid]}; "
                               f"{'query ids' if key == 'query_id' else 'ids'} must be unique")
        seen[rid] = line_no
        return rid

    @staticmethod
    def _check_chat_template(tokenizer, path: str, use_chat_template: bool, option: str) -> None:
        if use_chat_template and not getattr(tokenizer, "chat_template", None):
            raise DatasetError(f"use_chat_template=True but the tokenizer has no chat template (for {path}); "
                               f"set {option}=false or use a chat model's tokenizer")

    @staticmethod
    def _chat_prompt(tokenizer, text: str) -> str:
        """``text`` as a user turn of the chat template, followed by the assistant header."""
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)

    @staticmethod
    def _empty_check(items: Sequence[dict]) -> None:
        if not items:
            raise ValueError("cannot collate an empty list of items")


def encode_prompts(tokenizer, texts: Sequence[str], use_chat_template: bool) -> List[List[int]]:
    """Token ids of prompts ``texts``, as every prompt of a run and of its evaluation is encoded: with
    ``use_chat_template`` each text a user turn of the tokenizer's chat template followed by the assistant header
    (the template's own special tokens only), else the text with the tokenizer's special tokens (e.g. a BOS)."""
    if use_chat_template:
        texts = [RowDataset._chat_prompt(tokenizer, t) for t in texts]
    return _encode(tokenizer, list(texts), add_special_tokens=not use_chat_template)


# ----------------------------------------------------------------------------- SFT
class PromptAnswerDataset(RowDataset):
    """SFT rows ``{"prompt": str, "answer": str}`` (optional ``"id"``).

    Tokens are ``prompt + answer + [eos]`` (the prompt tokenized with the tokenizer's special
    tokens, e.g. a BOS, the answer without), truncated to ``max_seqlen``; ``prompt_mask`` is True on
    prompt tokens. Rows whose prompt alone fills ``max_seqlen`` (no answer token left to learn) are
    skipped with a warning. A sample's id is its ``id`` field, else its 0-based row index, as str.
    """

    REQUIRED: Dict[str, TypeSpec] = {"prompt": str, "answer": str}
    OPTIONAL: Dict[str, TypeSpec] = {"id": (str, int)}

    def __init__(self, path: str, tokenizer, max_seqlen: int):
        if max_seqlen < 2:
            raise ValueError(f"max_seqlen must be >= 2, got {max_seqlen}")
        rows = list(read_jsonl(path, self.REQUIRED, self.OPTIONAL))
        eos = _eos_id(tokenizer)
        prompts = _encode(tokenizer, [r["prompt"] for _, r in rows], True)
        answers = _encode(tokenizer, [r["answer"] for _, r in rows], False)
        self.items: List[dict] = []
        dropped, n_trunc, seen = [], 0, {}
        for idx, ((line_no, row), p, a) in enumerate(zip(rows, prompts, answers)):
            if len(p) >= max_seqlen:
                dropped.append(line_no)
                continue
            ids = p + a + [eos]
            if len(ids) > max_seqlen:
                n_trunc += 1
                ids = ids[:max_seqlen]
            rid = self._row_id(path, line_no, row, "id", idx, seen)
            self.items.append({"id": rid, "input_ids": ids, "prompt_mask": [True] * len(p) + [False] * (len(ids) - len(p))})
        # rows left out, for the run's warnings (None: none)
        self.skipped = _warn_dropped(path, f"whose prompt has >= max_seqlen={max_seqlen} tokens", dropped, len(rows),
                                     "dataset.max_seqlen")
        if n_trunc:
            logger.info("%s: truncated %d of %d sequences to max_seqlen=%d", path, n_trunc, len(rows), max_seqlen)
        if not self.items:
            raise DatasetError(f"{path}: every prompt has >= max_seqlen={max_seqlen} tokens; raise max_seqlen")
        logger.info("Loaded %d SFT rows from %s", len(self.items), path)

    @staticmethod
    def collate(items: Sequence[dict]) -> SequenceSample:
        RowDataset._empty_check(items)
        import torch

        from realhf.api.core.data_api import SequenceSample

        ids = [x for it in items for x in it["input_ids"]]
        mask = [x for it in items for x in it["prompt_mask"]]
        return SequenceSample.from_default(
            ids=[it["id"] for it in items],
            seqlens=[len(it["input_ids"]) for it in items],
            data={"packed_input_ids": torch.tensor(ids, dtype=torch.int64),
                  "prompt_mask": torch.tensor(mask, dtype=torch.bool)},
        )


# ----------------------------------------------------------------------------- prompts
class PromptDataset(RowDataset):
    """Prompt rows ``{"prompt": str}`` (optional ``"query_id"``, the sample id; default the 0-based
    row index). With ``use_chat_template`` each prompt becomes a user turn of the tokenizer's chat
    template followed by the assistant header. Prompts over ``max_prompt_len`` tokens are skipped
    with a warning. ``collate`` gives key ``packed_prompts`` and metadata ``query_id``, ``prompt``
    (the original text) and any extra keys in ``META_KEYS``.
    """

    REQUIRED: Dict[str, TypeSpec] = {"prompt": str}
    OPTIONAL: Dict[str, TypeSpec] = {"query_id": (str, int)}
    META_KEYS: Tuple[str, ...] = ("query_id", "prompt")

    def __init__(self, path: str, tokenizer, max_prompt_len: int, use_chat_template: bool = False):
        if max_prompt_len < 1:
            raise ValueError(f"max_prompt_len must be >= 1, got {max_prompt_len}")
        self.path = path
        self.tokenizer = tokenizer
        self.use_chat_template = use_chat_template
        self._check_chat_template(tokenizer, path, use_chat_template, "use_chat_template")
        rows = list(read_jsonl(path, self.REQUIRED, self.OPTIONAL))
        extras = [self._row_extra(f"{path}:{ln}", row) for ln, row in rows]
        encoded = encode_prompts(tokenizer, [self.template(row["prompt"]) for _, row in rows], use_chat_template)
        self.items: List[dict] = []
        dropped, seen = [], {}
        for idx, ((line_no, row), extra, ids) in enumerate(zip(rows, extras, encoded)):
            qid = self._row_id(path, line_no, row, "query_id", idx, seen)
            if len(ids) > max_prompt_len:
                dropped.append(line_no)
                continue
            self.items.append({"id": qid, "query_id": qid, "prompt": row["prompt"], "prompt_ids": ids, **extra})
        self.skipped = _warn_dropped(path, f"with more than max_prompt_len={max_prompt_len} tokens", dropped,
                                     len(rows), "dataset.max_prompt_len")  # rows left out, for the run's warnings
        if not self.items:
            raise DatasetError(f"{path}: every prompt has more than max_prompt_len={max_prompt_len} tokens; "
                               "raise max_prompt_len")
        logger.info("Loaded %d prompts from %s", len(self.items), path)

    # hooks for subclasses
    def _row_extra(self, where: str, row: dict) -> dict:
        return {}

    def template(self, text: str) -> str:
        """The prompt's text before the chat template (subclasses wrap it)."""
        return text

    def format_prompt(self, text: str) -> str:
        """The prompt's whole text as encoded: :meth:`template`, then the chat template when asked."""
        text = self.template(text)
        return self._chat_prompt(self.tokenizer, text) if self.use_chat_template else text

    def collate(self, items: Sequence[dict]) -> SequenceSample:
        self._empty_check(items)
        import torch

        from realhf.api.core.data_api import SequenceSample

        ids = [x for it in items for x in it["prompt_ids"]]
        return SequenceSample.from_default(
            ids=[it["id"] for it in items],
            seqlens=[len(it["prompt_ids"]) for it in items],
            data={"packed_prompts": torch.tensor(ids, dtype=torch.int64)},
            metadata={k: [it[k] for it in items] for k in self.META_KEYS},
        )


# ----------------------------------------------------------------------------- iteration
def epoch_steps(n_samples: int, batch_size: int, dp_size: int = 1, drop_last: bool = True) -> int:
    """Global batches per epoch of :class:`EpochIterator` (0 when not even one batch can be formed).

    ``drop_last=True``: ``n_samples // batch_size`` full batches. ``drop_last=False``: every sample is
    used; a remainder of at least ``dp_size`` samples is one more, smaller batch, a smaller remainder
    joins the last full batch (so that no data-parallel rank gets an empty share).
    """
    full, rest = divmod(int(n_samples), int(batch_size))
    if drop_last:
        return full
    if rest >= dp_size:
        return full + 1
    return full  # 0 < rest < dp_size folds into the last full batch; no full batch: nothing fits


class EpochIterator:
    """Global batches of ``batch_size`` samples, each split over ``dp_size`` data-parallel ranks.

    * Order: epoch ``e`` visits the samples in a permutation drawn from ``(seed, e)`` (identity
      when ``shuffle=False``), the same on every rank and independent of ``dp_size``.
    * Global batch ``s`` of an epoch is ``order[s*batch_size:(s+1)*batch_size]``; rank ``r`` gets a
      contiguous slice of it, sizes differing by at most one (lower ranks get the extra ones).
    * ``drop_last=True``: the last ``len % batch_size`` samples of each epoch's order are not used
      that epoch (every step has exactly ``batch_size`` samples; with shuffling, different samples are
      left out each epoch). ``drop_last=False``: every sample is used exactly once per epoch; the
      remainder forms a smaller last batch, or, when it has fewer samples than ``dp_size`` (some rank
      would get none), joins the last full batch (see :func:`epoch_steps`).
    * ``drop_last=None`` (default) drops only when shuffling: without shuffling the same samples
      would be left out of every epoch, i.e. never seen (e.g. prompts of a generation run).
    * State: ``(epoch, position)`` = the next global batch to produce. After the last batch of an
      epoch the state is ``(epoch + 1, 0)``. :meth:`state_dict` / :meth:`load_state_dict` resume
      exactly, with the same or a different ``dp_size``.
    """

    def __init__(self, dataset, batch_size: int, seed: int = 1, dp_rank: int = 0, dp_size: int = 1,
                 shuffle: bool = True, drop_last: Optional[bool] = None):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
        if batch_size < dp_size:
            raise ValueError(f"batch_size={batch_size} is smaller than dp_size={dp_size}; every data-parallel "
                             "rank needs at least one sample per batch")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.dataset = dataset
        self.n_samples = len(dataset)
        self.batch_size, self.seed = int(batch_size), int(seed)
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self.shuffle = bool(shuffle)
        self.drop_last = self.shuffle if drop_last is None else bool(drop_last)
        self.epoch = 0
        self.position = 0
        if self.steps_per_epoch == 0:
            raise ValueError(f"the dataset has {self.n_samples} samples, fewer than "
                             + (f"one batch of {batch_size} (drop_last=True)" if self.drop_last
                                else f"the {dp_size} data-parallel ranks that each need one"))

    @property
    def steps_per_epoch(self) -> int:
        return epoch_steps(self.n_samples, self.batch_size, self.dp_size, self.drop_last)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def epoch_order(self, epoch: int) -> List[int]:
        if not self.shuffle:
            return list(range(self.n_samples))
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_samples).tolist()

    def global_batch_indices(self, epoch: int, step: int) -> List[int]:
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} out of range [0, {self.steps_per_epoch})")
        last = step == self.steps_per_epoch - 1
        end = self.n_samples if last and not self.drop_last else (step + 1) * self.batch_size
        return self.epoch_order(epoch)[step * self.batch_size:end]

    def rank_share(self, global_indices: Sequence[int], dp_rank: Optional[int] = None) -> List[int]:
        r = self.dp_rank if dp_rank is None else dp_rank
        q, rem = divmod(len(global_indices), self.dp_size)
        start = r * q + min(r, rem)
        return list(global_indices[start:start + q + (1 if r < rem else 0)])

    def next_indices(self) -> List[int]:
        """This rank's dataset indices of the next batch; advances the state."""
        idx = self.rank_share(self.global_batch_indices(self.epoch, self.position))
        self.position += 1
        if self.position == self.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        return idx

    def next_batch(self):
        """The next batch of this rank, collated by ``dataset.collate`` (a list of items if it has none)."""
        items = [self.dataset[i] for i in self.next_indices()]
        collate = getattr(self.dataset, "collate", None)
        return collate(items) if collate is not None else items

    def __iter__(self):
        """The remaining batches of the current epoch (the state then points at the next epoch)."""
        epoch = self.epoch
        while self.epoch == epoch:
            yield self.next_batch()

    def state_dict(self) -> Dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "n_samples": self.n_samples,
                "batch_size": self.batch_size, "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for k in ("seed", "n_samples", "batch_size", "shuffle", "drop_last"):
            if k in state and state[k] != getattr(self, k):
                raise ValueError(f"cannot resume: the saved iterator has {k}={state[k]!r} but this one has "
                                 f"{k}={getattr(self, k)!r}; the sample order would differ")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.steps_per_epoch:
            raise ValueError(f"cannot resume at epoch={epoch}, position={position}: position must be in "
                             f"[0, {self.steps_per_epoch})")
        self.epoch, self.position = epoch, position


# ----------------------------------------------------------------------------- registry
_DATASETS: Dict[str, type] = {}


def register_dataset(name: str, cls: type) -> None:
    """Register a dataset class under ``name`` (re-registering the same class is a no-op)."""
    if name in _DATASETS and _DATASETS[name] is not cls:
        raise ValueError(f"dataset {name!r} is already registered as {_DATASETS[name].__name__}")
    _DATASETS[name] = cls


def make_dataset(name: str, **kwargs):
    """Build the dataset registered as ``name`` with ``kwargs``."""
    if name not in _DATASETS:
        close = difflib.get_close_matches(name, list(_DATASETS), n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise KeyError(f"unknown dataset {name!r}{hint} registered: {sorted(_DATASETS)}")
    return _DATASETS[name](**kwargs)


def registered_datasets() -> List[str]:
    return sorted(_DATASETS)


register_dataset("prompt_answer", PromptAnswerDataset)
register_dataset("prompt", PromptDataset)
