"""``auto_eval``: the optional evaluator that scores every saved checkpoint during training.

When ``auto_eval.enabled=true``, each HF checkpoint the master saves (``exp_ctrl.save_freq_*``) of the
trained policy (``actor`` in ppo-math, ``default`` in sft) is evaluated by
``realhf.evaluation.runner.evaluate_checkpoint`` in a separate process (training goes on; a crash there is
reported, never fatal), one evaluation at a time, and ``<dataset>/<metric>`` (``gsm8k/greedy_acc``,
``gsm8k/sample_pass@1``, ``gsm8k/pass@4``, ``gsm8k/maj@4``, ``gsm8k/greedy_length``, ...; accuracies as
fractions) is logged for the checkpoint's global step to ``stats.jsonl`` and TensorBoard. At the end
of training the master waits up to ``final_wait_secs`` for queued evaluations. Outputs (per-problem
jsonl, ``aggregate.json``, a log per evaluation) go to ``<run dir>/eval/<checkpoint tag>/``.

Example: ``auto_eval.enabled=true auto_eval.data_names=[gsm8k] auto_eval.max_problems=50
auto_eval.n_sampling=4 auto_eval.max_gen_tokens=256 auto_eval.prompt_type=chat``.
"""
import dataclasses
import math
import os
from typing import List, Optional

from realhf.api.quickstart.options import option

# mirrors realhf.evaluation.prompts.PROMPT_TYPES (realhf/api does not import the evaluation package)
EVAL_PROMPT_TYPES = ("qwen-boxed", "r1-distill", "plain", "chat")


def default_eval_data_dir() -> str:
    """``evaluation/data`` of the source tree realhf is imported from."""
    from realhf.base.process import source_root

    return os.path.join(source_root(), "evaluation", "data")


def _bad(key: str, value, expected: str):
    raise ValueError(f"auto_eval.{key}={value!r} is not allowed; expected {expected}")


def _int(key: str, value, lo: int, optional: bool = False):
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        _bad(key, value, f"an integer >= {lo}" + (" or null" if optional else ""))


def _pos(key: str, value, optional: bool = False):
    if optional and value is None:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        _bad(key, value, "a number > 0" + (" or null" if optional else ""))


@dataclasses.dataclass
class EvaluatorConfig:
    """Evaluate each saved checkpoint with evaluation/eval_and_aggregate.py in a background process."""

    enabled: bool = option(False, "evaluate every saved HF checkpoint of the trained policy (needs exp_ctrl.save_freq_*)")
    data_names: List[str] = option(help="datasets under data_dir (math_500, aime24, aime25, amc23, gsm8k, ...)",
                                   factory=lambda: ["gsm8k"])
    data_dir: Optional[str] = option(None, "datasets folder holding <name>/test.jsonl (null = evaluation/data)")
    max_problems: Optional[int] = option(50, "a fixed seeded subset of N problems per dataset (null = all)")
    n_sampling: int = option(4, "sampled answers per problem (0 = greedy pass only)")
    max_gen_tokens: int = option(256, "max new tokens per answer")
    prompt_type: str = option("chat", "qwen-boxed | r1-distill | plain | chat (the question alone in the chat template)")
    allow_last_number: bool = option(False, "grade the last number of an answer when it has no boxed/'answer is' answer")
    temperature: float = option(0.6, "temperature of the sampled pass")
    top_p: float = option(0.95, "top-p of the sampled pass")
    seed: int = option(1, "base seed of the problem subset and the per-problem sampling seeds")
    batch_size: int = option(16, "prompts per generation batch")
    threads: int = option(1, "torch threads of the evaluation process (it runs beside training)")
    device: str = option("cpu", "cpu | cuda (the evaluation process's own device; float32 on CPU, bfloat16 on CUDA)")
    timeout: Optional[float] = option(3600.0, "seconds one evaluation may run before it is stopped and reported "
                                              "as failed (null = no limit)")
    final_wait_secs: float = option(3600.0, "at the end of training, seconds the master waits for queued and "
                                            "running evaluations before it stops them")
    output_dir: Optional[str] = option(None, "folder of the evaluation outputs (null = <run dir>/eval)")

    def __post_init__(self):
        if not isinstance(self.enabled, bool):
            _bad("enabled", self.enabled, "true or false")
        names = self.data_names
        if isinstance(names, str):  # a comma-separated string is accepted too
            names = [n.strip() for n in names.split(",") if n.strip()]
        self.data_names = list(names)
        if not self.data_names or not all(isinstance(n, str) and n.strip() for n in self.data_names):
            _bad("data_names", self.data_names, "a non-empty list of dataset names, e.g. [gsm8k]")
        _int("max_problems", self.max_problems, 1, optional=True)
        _int("n_sampling", self.n_sampling, 0)
        _int("max_gen_tokens", self.max_gen_tokens, 1)
        _int("seed", self.seed, 0)
        _int("batch_size", self.batch_size, 1)
        _int("threads", self.threads, 1)
        if self.device not in ("cpu", "cuda"):
            _bad("device", self.device, "cpu or cuda")
        if self.prompt_type not in EVAL_PROMPT_TYPES:
            _bad("prompt_type", self.prompt_type, f"one of {list(EVAL_PROMPT_TYPES)}")
        if self.n_sampling > 0:
            from realhf.api.core.sampling_checks import MIN_TEMPERATURE

            t = self.temperature
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < MIN_TEMPERATURE:
                _bad("temperature", t, f"a finite number >= {MIN_TEMPERATURE:g} (the sampling rule of every generation)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            _bad("top_p", self.top_p, "a number in (0, 1]")
        _pos("timeout", self.timeout, optional=True)
        if not isinstance(self.final_wait_secs, (int, float)) or isinstance(self.final_wait_secs, bool) \
                or self.final_wait_secs < 0:
            _bad("final_wait_secs", self.final_wait_secs, "a number >= 0")
        if self.enabled:
            self.check_datasets()

    def check_datasets(self):
        """Fail before training starts when a dataset is missing (the message lists the available datasets)."""
        d = os.path.expanduser(self.data_dir) if self.data_dir else default_eval_data_dir()
        if not self.data_dir and not os.path.isdir(d):
            raise ValueError(f"auto_eval.data_dir=null reads evaluation/data of the realhf source tree, which is not "
                             f"at {d}; set auto_eval.data_dir to a folder holding <name>/test.jsonl")
        avail = sorted(n for n in (os.listdir(d) if os.path.isdir(d) else [])
                       if os.path.isfile(os.path.join(d, n, "test.jsonl")))
        missing = [n for n in self.data_names if n not in avail]
        if missing:
            raise ValueError(f"auto_eval.data_names={self.data_names!r}: no dataset {', '.join(map(repr, missing))} "
                             f"(<name>/test.jsonl) in {d}; available: {', '.join(avail) if avail else '(none)'}")

    def eval_kwargs(self) -> dict:
        """Options of ``realhf.evaluation.runner.evaluate_checkpoint`` (CLI dest names)."""
        return dict(data_dir=os.path.expanduser(self.data_dir) if self.data_dir else None,
                    max_problems=self.max_problems, n_sampling=self.n_sampling, max_gen_tokens=self.max_gen_tokens,
                    prompt_type=self.prompt_type, allow_last_number=self.allow_last_number,
                    temperature=self.temperature, top_p=self.top_p, seed=self.seed, batch_size=self.batch_size,
                    n_workers=0, threads_per_worker=self.threads, device=self.device, grader_workers=1)
