#!/usr/bin/env bash
# The one prepared run for a lent GPU (the device tool gives a session about 15 minutes in all,
# start-up included): correctness first, then every benchmark, each step under its own time limit
# so a slow one cannot eat the rest. Outputs go to $OUT (the device tool brings that folder back)
# or bench/results/gpu; commit them under bench/results/.
#   bash bench/gpu_session.sh            # from the repository root, on the GPU machine
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
step check      150 $py -m tritonq.check --json "$out/check.json"
step int4_gemm  120 $py -m tritonq.bench int4_gemm --models llama-2-7b --json "$out/int4_gemm.json"
step fp8        90  $py -m tritonq.bench fp8 --json "$out/fp8.json"
step attention  60  $py -m tritonq.bench attention --json "$out/attention.json"
step moe        60  $py -m tritonq.bench moe --out "$out/moe.json"
step generate   60  $py -m tritonq.bench generate --hidden 2048 --layers 8 --out "$out/generate.json"
step load       40  $py -m tritonq.bench load --gb 1.0 --device cuda --json "$out/load.json"
