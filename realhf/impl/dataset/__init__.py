"""Datasets read from JSONL files (prompt/answer, prompt-only, math, preference pairs) and synthetic arithmetic data."""
from realhf.impl.dataset.arithmetic import make_arithmetic_problems
from realhf.impl.dataset.jsonl import (
    DatasetError,
    EpochIterator,
    PromptAnswerDataset,
    PromptDataset,
    make_dataset,
    read_jsonl,
    register_dataset,
    registered_datasets,
    validate_jsonl,
)
from realhf.impl.dataset.math import MathPromptDataset, load_gsm8k, write_math_jsonl
from realhf.impl.dataset.preference import PreferenceDataset, validate_preference_jsonl
