"""Prompt templates: question -> prompt text and token ids, through the tokenizer's chat template.

* ``qwen-boxed`` — user turn "{question}\\nPlease reason step by step, and put your final answer
  within \\boxed{}.", then the assistant turn is opened (``add_generation_prompt``);
* ``r1-distill`` — the same user turn (DeepSeek-R1-distill style) and the assistant turn opens with
  ``<think>\\n`` (not added twice when the template already ends with it);
* ``plain`` — the question alone, no chat template.

A tokenizer without a chat template falls back to the plain text of the turn (with a warning).
"""
from __future__ import annotations

from typing import List, Tuple

from realhf.base import logging

logger = logging.getLogger(__name__)

STEP_BY_STEP = "Please reason step by step, and put your final answer within \\boxed{}."
# chat: the question alone as the user turn of the chat template (the main job's training format)
PROMPT_TYPES = ("qwen-boxed", "r1-distill", "plain", "chat")

_warned = set()


def user_turn(question: str, prompt_type: str) -> str:
    if prompt_type not in PROMPT_TYPES:
        raise ValueError(f"unknown prompt_type {prompt_type!r}; choose from {', '.join(PROMPT_TYPES)}")
    if prompt_type in ("plain", "chat"):
        return question
    return f"{question}\n{STEP_BY_STEP}"


def build_prompt(tokenizer, question: str, prompt_type: str) -> Tuple[str, List[int]]:
    """``(prompt text, prompt token ids)``."""
    turn = user_turn(question, prompt_type)
    if prompt_type == "plain":
        return turn, list(tokenizer(turn)["input_ids"])
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": turn}], add_generation_prompt=True,
                                             tokenize=False)
        if prompt_type == "r1-distill" and not text.rstrip(" ").endswith("<think>\n"):
            text += "<think>\n"
        # the rendered template already holds any BOS token
        return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])
    key = (getattr(tokenizer, "name_or_path", ""), prompt_type)
    if key not in _warned:
        _warned.add(key)
        logger.warning("tokenizer %s has no chat template: prompt_type %s falls back to plain text",
                       key[0] or "?", prompt_type)
    text = turn + ("\n<think>\n" if prompt_type == "r1-distill" else "\n")
    return text, list(tokenizer(text)["input_ids"])
