#!/usr/bin/env bash
# The whole GPU check in one command (a lent GPU's time is short): the `gpu` tests, then
# benchmarks/bench_cuda.py (the small models in fp32 and bf16 with a host profile, the 350M GPT
# in fp32, CPU offload), and on a machine of several GPUs benchmarks/bench_step.py on two of them
# (NCCL, one GPU per rank); each stage bounded, every log kept under OUT (default ./gpu_check).
#
#   bash benchmarks/gpu_check.sh [OUT]
#
# Where the machine's Python lacks a dependency (optree, attrs), put its wheels in .whl/ first:
# they are installed to a scratch directory. Roughly 3 minutes on one H200.
set -u
out="${1:-gpu_check}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/ffsdp_site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/ffsdp_site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/env.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$out/env.txt"
timeout 120 python3 -m pytest tests/device/test_streams_engine.py -m gpu -q -s -p no:cacheprovider \
  2>&1 | tail -20 | tee "$out/gpu_tests.txt"
run() {  # run NAME SECONDS ARGS...: one bench_cuda invocation, its table lines shown
  local name="$1" secs="$2"
  shift 2
  timeout "$secs" python3 benchmarks/bench_cuda.py --json "$out/$name.json" "$@" 2>&1 \
    | grep -v Warning | tee "$out/$name.txt" | grep -E "^(gpt|deep|#)|FAILED|phases"
}
run small 150 --models gpt13m,deep --recipes fp32,bf16 --profile 20
run big 90 --models gpt350m --recipes fp32 --variants fsdp2,ours,ours:0
run offload 90 --models gpt13m,deep --recipes offload
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$gpus" -ge 2 ]; then
  for model in gpt13m deep; do
    timeout 240 python3 benchmarks/bench_step.py --device cuda --world-size 2 --model "$model" \
      --rounds 1 --json "$out/step_$model.json" 2>&1 | grep -v Warning | tee "$out/step_$model.txt"
  done
fi
