#!/usr/bin/env bash
# The one prepared run for a lent GPU (the device tool gives a session about 15 minutes in all,
# start-up included): correctness first, then every benchmark, each step under its own time limit
# so a slow one cannot eat the rest. Outputs go to $OUT (the device tool brings that folder back)
# or bench/results/gpu; commit them under bench/results/.
#   bash bench/gpu_session.sh            # from the repository root, on the GPU machine
#   TUNE=1 bash bench/gpu_session.sh     # check, then sweep launch configs instead (~10 minutes)
# Uses the machine's own torch/triton/transformers (no install): PYTHONPATH points at this checkout.
set -uo pipefail
out=${OUT:-bench/results/gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
step() {  # step NAME SECONDS CMD...: run CMD with a time limit, keep its output in $out/NAME.txt
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  echo "=== $name: exit $? after ${SECONDS}s total"; tail -n 40 "$out/$name.txt"
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $py -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} > "$out/machine.txt" 2>&1; cat "$out/machine.txt"
step check      240 $py -m tritonq.check --json "$out/check.json"
# TUNE=1: instead of the benchmarks, sweep the launch configs of every kernel for Llama-2-7B /
# DeepSeek-V2-Lite shapes; winners go to $out/configs/<kernel>/<gpu>.json (copy them into
# tritonq/kernels/configs/, then rerun without TUNE to measure them).
if [ "${TUNE:-0}" = 1 ]; then
  cfg="$out/configs"
  step tune_int4      150 $py -m tritonq.tune --kernel int4_gemm --shapes 1x4096x4096,16x4096x4096,1x11008x4096,1x4096x11008 --config-dir "$cfg"
  step tune_fp8       120 $py -m tritonq.tune --kernel fp8_gemm --shapes 1x4096x4096,16x4096x4096,1024x4096x4096 --config-dir "$cfg"
  step tune_decode    90  $py -m tritonq.tune --kernel attention_decode --shapes 1x4096x32x8x128x128,8x4096x32x8x128x128,1x4096x16x1x576x512 --config-dir "$cfg"
  step tune_prefill   90  $py -m tritonq.tune --kernel attention_prefill --shapes 1x4096x32x8x128x128,1x2048x16x16x192x128 --config-dir "$cfg"
  step tune_moe       120 $py -m tritonq.tune --kernel moe --shapes 1x64x6x2048x1408,256x64x6x2048x1408 --config-dir "$cfg"
  exit 0
fi
step int4_gemm  120 $py -m tritonq.bench int4_gemm --models llama-2-7b --json "$out/int4_gemm.json"
step fp8        90  $py -m tritonq.bench fp8 --json "$out/fp8.json"
step attention  60  $py -m tritonq.bench attention --json "$out/attention.json"
step moe        60  $py -m tritonq.bench moe --out "$out/moe.json"
# decode tokens/s at batch 1, 8, 32 with and without CUDA graphs, random AWQ Llama-2-7B shape (#18)
step generate   180 $py -m tritonq.bench generate --device cuda --repeat 2 --out "$out/generate.json"
step load       30  $py -m tritonq.bench load --gb 1.0 --device cuda --json "$out/load.json"
