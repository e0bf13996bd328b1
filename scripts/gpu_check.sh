#!/usr/bin/env bash
# The CUDA path on a GPU machine, in one go (at most 8 minutes: the benchmark's 4, then the tests' 4; results in docs/performance.md):
#   1. benchmarks/bench_scale.py: the RL step at users' scale, on the card this machine has: a Qwen2.5-1.5B-shaped
#      model (random weights, built on the GPU), 16 GSM8K prompts x 8 answers of exactly 1,024 tokens, KL loss 0.04,
#      3 steps in each mode (colocated, a generation server beside the trainer, asynchronous), each MFC's time beside
#      its floor from the matmul and copy ceilings measured first, and its peak memory. The script shares
#      BENCH_LIMIT (default 240 s) among the modes and stops a mode that runs over, reporting its finished steps.
#      BENCH_LONG=1: answers of 8,192 tokens from 2 prompts instead (give it a larger BENCH_LIMIT);
#      BENCH_ARGS: more flags (e.g. "--modes colocated", or "--compare-transformers --shape smollm2" for the
#      in-process comparisons against transformers)
#   2. pytest -m gpu (tests/gpu/test_gpu_path.py, tests/gpu/test_gen_server_gpu.py); tests needing 2 GPUs, vLLM,
#      SGLang or flash-attn skip themselves where those are missing
#   3. the tiny-model GRPO and PPO learning tests (tests/e2e/test_grpo_learns.py), which on a CUDA machine run their
#      workers on cuda:0 in bf16 with NCCL, as a user's run would; and those with a generation server (synchronous
#      and asynchronous GRPO), which on a one-GPU machine share the GPU with the trainer (gpus_per_node=1)
#   PLAN=1 (after 1, before 2 and 3; PLAN_LIMIT seconds, default 150): benchmarks/bench_plan.py scale: the planner's
#      profiler on this card (kernels, the control plane, a generation server) and each synchronous launch of (1)
#      beside the step simulator's estimate of it; off by default, as it takes the script past 8 minutes unless
#      TEST_LIMIT is lowered or TESTS=0 leaves out (2) and (3) (the benchmark and the planner: about 6.5 minutes)
# (2) and (3) run side by side after (1) (SKIP_BENCH=1 skips it; LEARN_K / LEARN_SERVED_K pick the learning tests). Logs go to $OUT (default outputs/gpu_check); the last lines of each
# are printed. Python packages missing on the machine may be given as wheels in .whl/ (installed to
# /tmp/site); for a machine with PyTorch but none of realhf's other requirements (Python 3.12):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl pyzmq omegaconf hydra-core latex2sympy2-extended gguf
#   pip wheel --no-deps antlr4-python3-runtime==4.9.3 -w .whl
# Exit status: non-zero if any part failed.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 3
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi -L
python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'devices', torch.cuda.device_count())"

status=0
part() {  # part NAME SECONDS CMD...: run CMD under a time limit, its output to $OUT/NAME.log
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "=== $name: exit $rc after $(($(date +%s) - start)) s"
  return $rc
}
show() { tail -n "${2:-25}" "$OUT/$1.log"; }

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  BENCH_LIMIT=${BENCH_LIMIT:-240}
  BENCH_WORK="--answer-tokens 1024"
  [ "${BENCH_LONG:-0}" = 1 ] && BENCH_WORK="--answer-tokens 8192 --prompts 2"
  # the script keeps 20 s of the limit for stopping a mode that runs over; timeout is the backstop
  part bench "$BENCH_LIMIT" python3 benchmarks/bench_scale.py --shape 1.5b --modes colocated,served,async --steps 3 \
    $BENCH_WORK --budget-s $((BENCH_LIMIT - 20)) --root "$OUT/bench_scale" ${BENCH_ARGS:-} || status=1
  grep -h -E '"part": "(env|ceilings)"' "$OUT/bench.log"
  show bench 16
fi
if [ "${PLAN:-0}" = 1 ] && [ -f "$OUT/bench.log" ]; then
  part plan "${PLAN_LIMIT:-150}" python3 benchmarks/bench_plan.py scale --bench-log "$OUT/bench.log" || status=1
  show plan 8
fi
if [ "${TESTS:-1}" = 0 ]; then
  exit $status
fi
PYTEST="python3 -m pytest -o addopts= -p no:cacheprovider -rs --timeout 240"
part pytest_gpu "${TEST_LIMIT:-240}" $PYTEST -m gpu tests/gpu/test_gpu_path.py tests/gpu/test_gen_server_gpu.py -v &
gpu_pid=$!
part learn "${TEST_LIMIT:-190}" $PYTEST tests/e2e/test_grpo_learns.py -k "${LEARN_K:-grpo_learns_tiny or ppo_with_critic}" -v -s &
learn_pid=$!
# the runs with a generation server: on a one-GPU machine it shares the GPU with the trainer (gpus_per_node=1; weights
# go to it by CUDA IPC handles, gen_server.weight_transport=auto's choice there, or through disk in the asynchronous run)
part learn_served "${TEST_LIMIT:-190}" $PYTEST tests/e2e/test_grpo_learns.py \
  -k "${LEARN_SERVED_K:-through_generation_servers or async_grpo_learns}" -v -s &
served_pid=$!
wait $gpu_pid || status=1
wait $learn_pid || status=1
wait $served_pid || status=1
show pytest_gpu 30
grep -E "held-out greedy accuracy|passed|failed|Error" "$OUT/learn.log" "$OUT/learn_served.log" | tail -n 20
grep -h -m3 "CUDA graph" "$OUT/learn.log" "$OUT/learn_served.log" "$OUT/pytest_gpu.log"
exit $status
