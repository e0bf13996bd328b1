import json
import os

import pytest
import torch

from realhf.api.core.data_api import SequenceSample
from realhf.base.process import source_root
from realhf.impl.dataset import (
    DatasetError,
    EpochIterator,
    MathPromptDataset,
    PromptAnswerDataset,
    PromptDataset,
    load_gsm8k,
    make_arithmetic_problems,
    make_dataset,
    read_jsonl,
    register_dataset,
    validate_jsonl,
    write_math_jsonl,
)
from realhf.impl.dataset.jsonl import epoch_steps
from realhf.impl.model.tiny import tiny_tokenizer

GSM8K = os.path.join(source_root(), "realhf", "data", "gsm8k", "test.jsonl")


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ----------------------------------------------------------------------------- reading
@pytest.mark.parametrize(
    "lines, fragments",
    [
        (['{"prompt": "a", "answer": "b"}', '{"prompt": "c", "answer": "d"}', '{"prompt": "e", "answer": '],
         ["file.jsonl:3", "not valid JSON", "'prompt' (string)"]),
        (['{"prompt": "a", "answer": "b"}', '{"prompt": "c"}'], ["file.jsonl:2", "missing field 'answer'"]),
        (['{"prompt": "a", "answer": 3}'], ["file.jsonl:1", "'answer' must be a string", "int"]),
        (['{"prompt": "  ", "answer": "x"}'], ["file.jsonl:1", "'prompt' is empty"]),
        (['[1, 2]'], ["file.jsonl:1", "expected a JSON object"]),
        (['{"prompt": "a", "answer": "b", "id": [1]}'], ["file.jsonl:1", "'id' must be a string or integer"]),
        (['', '   '], ["file.jsonl is empty", "'answer'"]),
    ],
)
def test_bad_jsonl(tmp_path, lines, fragments):
    p = tmp_path / "file.jsonl"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError) as ei:
        validate_jsonl(str(p), PromptAnswerDataset.REQUIRED, PromptAnswerDataset.OPTIONAL)
    for frag in fragments:
        assert frag in str(ei.value), (frag, str(ei.value))


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_row_over_the_byte_limit_is_rejected_by_size(tmp_path, newline):
    row = json.dumps({"prompt": "x" * 80, "answer": "y"})  # 101 bytes
    p = tmp_path / "big.jsonl"
    p.write_bytes(("{\"prompt\": \"a\", \"answer\": \"b\"}" + newline + row + newline + "[not json" + newline).encode())
    req = PromptAnswerDataset.REQUIRED
    with pytest.raises(DatasetError, match=rf"big\.jsonl:2: the row has {len(row)} bytes, over the limit of 100 bytes"):
        validate_jsonl(str(p), req, max_row_bytes=100)
    with pytest.raises(DatasetError, match=r"big\.jsonl:3: not valid JSON"):  # a row of exactly the limit is read
        validate_jsonl(str(p), req, max_row_bytes=len(row))
    # an oversized last row without a newline, measured in pieces
    p.write_bytes(("{\"prompt\": \"a\", \"answer\": \"b\"}" + newline + "z" * 5000).encode())
    with pytest.raises(DatasetError, match=r"big\.jsonl:2: the row has 5000 bytes, over the limit of 100 bytes"):
        list(read_jsonl(str(p), req, max_row_bytes=100))


def test_read_jsonl_basics(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"prompt": "a", "n": 1}\n\n{"prompt": "b", "n": 2.5}\n')
    rows = list(read_jsonl(str(p), {"prompt": str, "n": float}))
    assert [ln for ln, _ in rows] == [1, 3]
    with pytest.raises(DatasetError, match="'n' must be a integer"):
        list(read_jsonl(str(p), {"prompt": str, "n": int}))
    p.write_text('{"prompt": "a", "n": true}\n')
    with pytest.raises(DatasetError, match="x.jsonl:1"):
        list(read_jsonl(str(p), {"prompt": str, "n": int}))
    with pytest.raises(DatasetError, match="no such file"):
        validate_jsonl(str(tmp_path / "missing.jsonl"), {"prompt": str})
    p.write_bytes(b'{"prompt": "\xff"}\n')
    with pytest.raises(DatasetError, match="x.jsonl:1: not UTF-8"):
        validate_jsonl(str(p), {"prompt": str})


# ----------------------------------------------------------------------------- SFT
def test_sft_dataset(tmp_path, tok):
    rows = [{"prompt": "What is 1+1?", "answer": "2"}, {"prompt": "Say hello", "answer": "hello there friend"},
            {"prompt": "x " * 50, "answer": "too long prompt"}, {"prompt": "Count", "answer": "one two three four five six"}]
    path = _rows(tmp_path / "sft.jsonl", rows)
    ds = PromptAnswerDataset(path, tok, max_seqlen=12)
    assert len(ds) == 3  # the over-long prompt is skipped
    eos = tok.eos_token_id
    for it, row in zip([ds[0], ds[1]], rows[:2]):
        p = tok(row["prompt"])["input_ids"]
        a = tok(row["answer"], add_special_tokens=False)["input_ids"]
        assert it["input_ids"] == (p + a + [eos])[:12]
        assert it["prompt_mask"] == [True] * len(p) + [False] * (len(it["input_ids"]) - len(p))
        assert all(type(x) is int for x in it["input_ids"])
    last = ds[2]
    assert len(last["input_ids"]) == 12 and last["input_ids"][-1] != eos  # truncated
    assert [ds[i]["id"] for i in range(3)] == ["0", "1", "3"]
    s = ds.collate([ds[0], ds[2]])
    assert isinstance(s, SequenceSample) and s.ids == ["0", "3"]
    assert s.keys == {"packed_input_ids", "prompt_mask"}
    assert s.data["packed_input_ids"].dtype == torch.int64 and s.data["prompt_mask"].dtype == torch.bool
    assert s.seqlens["packed_input_ids"] == [[len(ds[0]["input_ids"])], [12]]
    assert s.data["packed_input_ids"].tolist() == ds[0]["input_ids"] + ds[2]["input_ids"]
    assert s.data["prompt_mask"].tolist() == ds[0]["prompt_mask"] + ds[2]["prompt_mask"]
    # round trip through the wire format
    assert SequenceSample.from_bytes(s.to_bytes()).data["prompt_mask"].tolist() == s.data["prompt_mask"].tolist()


def test_sft_duplicate_ids(tmp_path, tok):
    path = _rows(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "b", "id": 7}, {"prompt": "c", "answer": "d", "id": "7"}])
    with pytest.raises(DatasetError, match="d.jsonl:2: id '7' repeats the one on line 1"):
        PromptAnswerDataset(path, tok, 16)


# ----------------------------------------------------------------------------- prompts / math
def test_prompt_dataset(tmp_path, tok):
    path = _rows(tmp_path / "p.jsonl", [{"prompt": "hello", "query_id": "q1"}, {"prompt": "world"}])
    ds = PromptDataset(path, tok, max_prompt_len=64, use_chat_template=True)
    assert [it["query_id"] for it in ds.items] == ["q1", "1"]
    templ = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True)
    assert ds[0]["prompt_ids"] == tok(templ, add_special_tokens=False)["input_ids"]
    s = ds.collate([ds[0], ds[1]])
    assert s.keys == {"packed_prompts"} and s.ids == ["q1", "1"]
    assert s.metadata["prompt"] == ["hello", "world"] and s.metadata["query_id"] == ["q1", "1"]
    plain = make_dataset("prompt", path=path, tokenizer=tok, max_prompt_len=64)
    assert plain[0]["prompt_ids"] == tok("hello")["input_ids"]
    with pytest.raises(DatasetError, match="every prompt has more than max_prompt_len=1"):
        PromptDataset(path, tok, max_prompt_len=1)
    dup = _rows(tmp_path / "dup.jsonl", [{"prompt": "a", "query_id": "x"}, {"prompt": "b", "query_id": "x"}])
    with pytest.raises(DatasetError, match="dup.jsonl:2: query_id 'x'"):
        PromptDataset(dup, tok, 64)
    assert plain.skipped is None
    long = _rows(tmp_path / "long.jsonl", [{"prompt": "hello"}, {"prompt": "hello " * 40}, {"prompt": "world"}])
    part = PromptDataset(long, tok, max_prompt_len=8)
    assert len(part) == 2 and part.skipped is not None
    assert "long.jsonl: skipped 1 of 3 rows" in part.skipped and "(lines 2)" in part.skipped
    assert "dataset.max_prompt_len" in part.skipped  # what to change, for the run's warning


def test_math_dataset(tmp_path, tok):
    rows = make_arithmetic_problems(20, seed=3, kind="mixed")
    path = str(tmp_path / "math.jsonl")
    assert write_math_jsonl(rows, path) == 20
    ds = MathPromptDataset(path, tok, max_prompt_len=256)
    assert len(ds) == 20
    s = ds.collate([ds[i] for i in range(4)])
    assert s.metadata["solutions"] == [r["solutions"] for r in rows[:4]]
    assert s.metadata["task"] == ["math"] * 4 and s.ids == [r["query_id"] for r in rows[:4]]
    assert "\\boxed{}" in ds.format_prompt("q")
    ds2 = make_dataset("math_prompt", path=path, tokenizer=tok, max_prompt_len=256, use_chat_template=False,
                       prompt_template="Q: {prompt}\nA:")
    assert ds2[0]["prompt_ids"] == tok("Q: " + rows[0]["prompt"] + "\nA:")["input_ids"]
    bad = _rows(tmp_path / "bad.jsonl", [{"query_id": 1, "prompt": "p", "solutions": ["1"]},
                                         {"query_id": 2, "prompt": "p", "solutions": []}])
    with pytest.raises(DatasetError, match="bad.jsonl:2: field 'solutions' must be a non-empty list"):
        MathPromptDataset(bad, tok, 64)
    bad = _rows(tmp_path / "bad2.jsonl", [{"query_id": 1, "prompt": "p"}])
    with pytest.raises(DatasetError, match="bad2.jsonl:1: missing field 'solutions'"):
        MathPromptDataset(bad, tok, 64)
    with pytest.raises(DatasetError, match="not unique"):
        write_math_jsonl(rows[:2] + rows[:1], str(tmp_path / "x.jsonl"))
    with pytest.raises(ValueError, match="prompt_template"):
        MathPromptDataset(path, tok, 64, prompt_template="no placeholder")


def test_gsm8k(tmp_path):
    rows = load_gsm8k(GSM8K)
    assert len(rows) == 1319 and rows[0]["solutions"] == ["18"] and rows[0]["query_id"] == "gsm8k-test-0"
    assert len({r["query_id"] for r in rows}) == 1319
    assert all("," not in r["solutions"][0] for r in rows)
    p = tmp_path / "g.jsonl"
    p.write_text(json.dumps({"question": "q", "answer": "so 1,234\n#### 1,234"}) + "\n"
                 + json.dumps({"question": "q2", "answer": "no final answer"}) + "\n")
    with pytest.raises(DatasetError, match="g.jsonl:2.*####"):
        load_gsm8k(str(p))


def test_arithmetic():
    a = make_arithmetic_problems(50, seed=7, kind="add")
    assert a == make_arithmetic_problems(50, seed=7, kind="add")
    assert a != make_arithmetic_problems(50, seed=8, kind="add")
    assert len({r["query_id"] for r in a}) == 50
    for r in a:
        nums = [int(w) for w in r["prompt"].replace("?", "").split() if w.isdigit()]
        assert r["solutions"] == [str(sum(nums))] and "How many" in r["prompt"]
    for r in make_arithmetic_problems(100, seed=1, kind="mixed"):
        assert int(r["solutions"][0]) >= 0
    for r in make_arithmetic_problems(30, seed=1, kind="easy"):
        x, y = r["prompt"].rstrip("=").split("+")
        assert len(x) == len(y) == 1 and r["solutions"] == [str(int(x) + int(y))]
    with pytest.raises(ValueError, match="kind"):
        make_arithmetic_problems(3, kind="div")


def test_registry():
    with pytest.raises(KeyError, match="did you mean 'math_prompt'"):
        make_dataset("math_promt")
    register_dataset("prompt", PromptDataset)  # idempotent
    with pytest.raises(ValueError, match="already registered"):
        register_dataset("prompt", MathPromptDataset)


# ----------------------------------------------------------------------------- iteration
class _Range:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def _drain(it, n_batches):
    return [it.next_batch() for _ in range(n_batches)]


def test_epoch_iterator_determinism_and_coverage():
    ds = _Range(23)
    it = EpochIterator(ds, batch_size=5, seed=3)
    assert len(it) == 4
    e0 = [x for b in it for x in b]
    assert it.epoch == 1 and it.position == 0
    e1 = [x for b in it for x in b]
    assert len(e0) == len(set(e0)) == 20 and e0 != e1
    it2 = EpochIterator(ds, batch_size=5, seed=3)
    assert [x for b in it2 for x in b] == e0
    assert EpochIterator(ds, 5, seed=3, shuffle=False).next_batch() == [0, 1, 2, 3, 4]
    # drop_last=False keeps the remainder of 3 (>= dp_size)
    it3 = EpochIterator(ds, batch_size=5, seed=3, drop_last=False)
    assert len(it3) == 5 and sorted(x for b in it3 for x in b) == list(range(23))
    # ... and folds it into the last full batch when some rank would get nothing
    for shuffle in (False, True):
        its = [EpochIterator(ds, batch_size=5, seed=3, drop_last=False, dp_size=4, dp_rank=r, shuffle=shuffle)
               for r in range(4)]
        assert len(its[0]) == 4 and epoch_steps(23, 5, 4, drop_last=False) == 4
        shares = [[it.next_batch() for _ in range(4)] for it in its]
        assert sum(len(s[-1]) for s in shares) == 8 and min(len(b) for s in shares for b in s) >= 1
        assert sorted(x for s in shares for b in s for x in b) == list(range(23))
    # without shuffling nothing is dropped by default (the same samples would be left out every epoch)
    assert len(EpochIterator(ds, batch_size=5, shuffle=False)) == 5
    assert len(EpochIterator(_Range(5), batch_size=4, shuffle=False, dp_size=2)) == 1  # 4 + 1 in one batch
    with pytest.raises(ValueError, match="fewer than the 4 data-parallel ranks"):
        EpochIterator(_Range(3), batch_size=5, dp_size=4, drop_last=False)
    with pytest.raises(ValueError, match="fewer than one batch"):
        EpochIterator(_Range(3), batch_size=5)
    with pytest.raises(ValueError, match="smaller than dp_size"):
        EpochIterator(ds, batch_size=2, dp_size=3)


@pytest.mark.parametrize("dp_size", [1, 2, 3])
def test_dp_sharding_covers_each_sample_once(dp_size):
    ds = _Range(31)  # 4 full batches + a remainder of 3 >= dp_size
    its = [EpochIterator(ds, batch_size=7, seed=5, dp_rank=r, dp_size=dp_size, drop_last=False) for r in range(dp_size)]
    ref = EpochIterator(ds, batch_size=7, seed=5, drop_last=False)
    for _ in range(2):  # two epochs
        seen = []
        for step in range(len(ref)):
            shares = [it.next_batch() for it in its]
            assert [x for s in shares for x in s] == ref.next_batch()  # union = the global batch, in order
            assert max(map(len, shares)) - min(map(len, shares)) <= 1 and min(map(len, shares)) >= 1
            seen += [x for s in shares for x in s]
        assert sorted(seen) == list(range(31))


@pytest.mark.parametrize("stop_after", [2, 4, 6, 11])  # mid-epoch, epoch boundary, ...
def test_resume_is_exact(stop_after):
    ds = _Range(17)
    full = _drain(EpochIterator(ds, batch_size=4, seed=9), 16)
    it = EpochIterator(ds, batch_size=4, seed=9)
    first = _drain(it, stop_after)
    state = json.loads(json.dumps(it.state_dict()))
    if stop_after % 4 == 0:
        assert state["position"] == 0 and state["epoch"] == stop_after // 4
    resumed = EpochIterator(ds, batch_size=4, seed=9)
    resumed.load_state_dict(state)
    assert first + _drain(resumed, 16 - stop_after) == full
    # a different dp layout resumes the same global order
    shards = [EpochIterator(ds, batch_size=4, seed=9, dp_rank=r, dp_size=2) for r in range(2)]
    for s in shards:
        s.load_state_dict(state)
    assert [a + b for a, b in zip(_drain(shards[0], 3), _drain(shards[1], 3))] == full[stop_after:stop_after + 3]


def test_resume_rejects_incompatible_state():
    it = EpochIterator(_Range(17), batch_size=4, seed=9)
    with pytest.raises(ValueError, match="seed=1"):
        it.load_state_dict({**it.state_dict(), "seed": 1})
    with pytest.raises(ValueError, match="n_samples"):
        EpochIterator(_Range(18), batch_size=4, seed=9).load_state_dict(it.state_dict())
    with pytest.raises(ValueError, match="position"):
        it.load_state_dict({**it.state_dict(), "position": 4})


def test_iterator_collates(tmp_path, tok):
    path = str(tmp_path / "m.jsonl")
    write_math_jsonl(make_arithmetic_problems(10, seed=1, kind="easy"), path)
    ds = MathPromptDataset(path, tok, 32, use_chat_template=False, prompt_template="{prompt}")
    it = EpochIterator(ds, batch_size=4, seed=1, dp_rank=1, dp_size=2)
    b = it.next_batch()
    assert isinstance(b, SequenceSample) and b.bs == 2 and "solutions" in b.metadata
