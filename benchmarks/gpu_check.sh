#!/usr/bin/env bash
# The whole GPU check in one command (a lent GPU's time is short): the `gpu` tests (FSDP2
# parity, overlap, the compiled step with aot_eager and inductor), then
# benchmarks/bench_cuda.py (the small models in fp32 and bf16 with a host profile, the 350M GPT
# in fp32, CPU offload), on a machine of several GPUs benchmarks/bench_step.py on two of them
# (NCCL, one GPU per rank), then the CPU path on this machine (the main job, example 05, the
# suite); each stage bounded, every log kept under OUT (default ./gpu_check).
#
#   bash benchmarks/gpu_check.sh [OUT]
#
# Where the machine's Python lacks a dependency (optree, attrs), put its wheels in .whl/ first:
# they are installed to a scratch directory. Roughly 6 minutes on one H200.
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
FFSDP_TEST_GPU=1 timeout 240 python3 -m pytest tests/device/test_streams_engine.py tests/device/test_cuda_compiled_step.py \
  -m gpu -q -s -p no:cacheprovider 2>&1 | tail -30 | tee "$out/gpu_tests.txt"
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
# The CPU path on a machine with a GPU (ranks on gloo, as a user runs the README there): the
# main job, example 05 (its ranks save through torch.distributed.checkpoint, which asks for a
# CUDA stream when CUDA is available), which import of the ranks' fork server initialises CUDA
# (a rank forked from it then cannot use CUDA at all), and the suite (tests/conftest.py hides
# the GPU from it), each bounded.
timeout 90 python3 -m functional_fsdp.train --steps 5 2>&1 | tail -7 | tee "$out/main_job.txt"
timeout 90 python3 examples/05_custom_trainer.py --steps 4 2>&1 | tail -2 | tee "$out/example05.txt"
PYTHONPATH="$PWD/tests:$PYTHONPATH" timeout 60 python3 - <<'PY' 2>&1 | tee "$out/cuda_init.txt"
import importlib
import torch
from _dist import PRELOAD
from _warm_compile import _FIRST_COMPILE
from functional_fsdp.shell.processes import PRELOAD as RUN_LOCAL_PRELOAD
for name in (*RUN_LOCAL_PRELOAD, *PRELOAD, *_FIRST_COMPILE):
    importlib.import_module(name)
    print(f"import {name}: CUDA initialised {torch.cuda.is_initialized()}")
PY
timeout 200 python3 -m pytest -q -p no:cacheprovider -n "$(( $(nproc) > 4 ? $(nproc) - 2 : 2 ))" \
  --timeout 150 -rfE 2>&1 | tail -25 | tee "$out/suite.txt"
