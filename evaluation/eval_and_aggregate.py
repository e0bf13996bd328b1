"""Evaluate a checkpoint on math benchmarks and print one table.

    python evaluation/eval_and_aggregate.py --model_path CKPT --output_path OUT \\
        --data_names math_500,aime24,amc23 --max_gen_tokens 32768

Runs a greedy pass and a sampled pass (``--n_sampling`` answers, ``--temperature``, ``--top_p``)
per dataset with realhf's own engine over ``--n_workers`` processes (or ``--engine vllm``), grades
with ``realhf.reward``, and prints ``dataset | num_questions | greedy_length | sample_length |
greedy_acc | sample_pass@1 | pass@8 | pass@16 | maj@n | pass@32`` ('-' where k > n_sampling).
Outputs (per-problem jsonl per dataset and pass, ``aggregate.json``, ``table.txt``) go to
``--output_path``; a re-run with the same arguments reuses them (``--overwrite`` regenerates).
The pipeline is ``realhf.evaluation`` (see ``realhf/evaluation/runner.py``); this file is its command line.
Exit code 2 on a user error.
"""
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # the source tree this file belongs to, installed or not
    sys.path.insert(0, _ROOT)

from realhf.evaluation.runner import EvalError, build_parser, evaluate_checkpoint, main, run_evaluation  # noqa: E402

__all__ = ["EvalError", "build_parser", "evaluate_checkpoint", "main", "run_evaluation"]

if __name__ == "__main__":
    sys.exit(main())
