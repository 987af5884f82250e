#!/usr/bin/env bash
# The one prepared command for a lent GPU: correctness first, then the headline figures, then the other
# benchmarks while the time allows. Made for the device tool's machine (one H200, no network: the image's
# python3 with torch/triton/transformers/pytest-xdist/pytest-timeout, nothing installed; a command may run
# 600 s; at most 8 files come back from $OUT; a bare machine, so every Triton kernel is a cold JIT compile).
#   bash bench/gpu_session.sh              # from the repository root; OUT=folder (default bench/results/gpu)
#   DRY_RUN=1 bash bench/gpu_session.sh    # print the steps, write placeholder results (no GPU needed)
#   STEP=tune bash bench/gpu_session.sh    # its own device command: tune the launch configs first (240 s at most),
#                                          # then benchmark with them; the tuned JSON comes back in configs/
# Writes three files to $OUT (STEP=tune: session.log, results.json and configs/<kernel>/<gpu>.json):
# session.log (everything printed), check.xml (the check's JUnit XML),
# results.json (the machine, each step's exit status / seconds / limit and its benchmark JSON, merged from
# a temporary folder outside $OUT at the end, also after a step ran out of time). Exit 1 if a step failed.
# Time: the script stops itself by TOTAL seconds. Each step runs under `timeout -s INT -k KILL LIMIT`
# (SIGINT: pytest still writes its JUnit XML, Python cleans up its temp checkpoints); the headline steps'
# limits add up to 420 s (tests/bench/test_gpu_session.py checks it), so a rerun fits the device time; the other
# steps run only while their limit still fits under TOTAL.
set -uo pipefail
TOTAL=${TOTAL:-540}   # s, the whole script, kill grace and merge included (TOTAL=420 for a shorter session)
KILL=10     # s after SIGINT before SIGKILL
MERGE=20    # s reserved for merging the results at the end
out=${OUT:-bench/results/gpu}
py=${PYTHON:-python3}
mkdir -p "$out"
work=$(mktemp -d)   # per-step JSON files; only the merged results.json goes to $out
trap 'rm -rf "$work"' EXIT
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }

# step NAME LIMIT CMD...: run CMD with a time limit; its benchmark JSON (if any) is $work/NAME.json
step() {
  local name=$1 limit=$2 begin rc; shift 2
  begin=$(elapsed)
  echo "=== [${begin} s] $name (limit $limit s): $*"
  if [ "${DRY_RUN:-0}" = 1 ]; then
    echo '{"dry_run": true}' > "$work/$name.json"; rc=0
  else
    timeout -s INT -k "$KILL" "$limit" "$@"; rc=$?
  fi
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(elapsed) - begin ))" "$limit" >> "$work/steps.tsv"
  echo "=== [$(elapsed) s] $name: exit $rc$([ "$rc" = 124 ] && echo " (ran out of its $limit s)")"
}
# optional NAME LIMIT CMD...: a step that runs only if its limit still fits under TOTAL (kill grace and merge kept)
optional() {
  if (( $(elapsed) + $2 + KILL + MERGE + KILL > TOTAL )); then
    echo "=== [$(elapsed) s] $1 skipped: its $2 s no longer fit in the script's $TOTAL s"
    printf '%s\tskipped\t0\t%s\n' "$1" "$2" >> "$work/steps.tsv"
  else
    step "$@"
  fi
}

session() {
  # --- headline steps (limits add up to 420 s) -------------------------------------------------------
  # machine: GPU, versions, CPUs (expected ~5 s: importing torch)
  step machine 20 "$py" - "$work/machine.json" <<'PY'
import json, os, shutil, subprocess, sys, torch, triton, transformers
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip() if shutil.which("nvidia-smi") else None
info = dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None, nvidia_smi=smi,
            python=sys.version.split()[0], torch=torch.__version__, cuda=torch.version.cuda,
            triton=triton.__version__, transformers=transformers.__version__, cpus=os.cpu_count())
print(info)
open(sys.argv[1], "w").write(json.dumps(info))
PY
  # check: the kernel and gpu tests (~210; ~200 cold Triton compiles) in 8 xdist processes, 150 s per test
  # (expected 90-150 s: test_every_kernel_at_realistic_shapes_on_the_gpu alone compiles ~60 kernels)
  step check 180 "$py" -m tritonq.check --workers 8 --timeout 150 --junitxml "$out/check.xml"
  # int4 GEMM at M = 1..16 vs torch fp16 matmul, N=K=4096 and the Llama-2-7B linears (expected ~25 s)
  step int4_gemm 50 "$py" -m tritonq.bench int4_gemm --models llama-2-7b --m 1,2,4,8,16 --json "$work/int4_gemm.json"
  # decode tokens/s of a random AWQ Llama-2-7B (32 layers) at batch 1 and 8, CUDA graphs and eager; batch 1 as a
  # fraction of the weight-read floor at the measured copy bandwidth (expected ~60-80 s: writing the 3.9 GB
  # checkpoint ~20 s, loading ~15 s, graph capture and compiles ~20 s)
  step generate 110 "$py" -m tritonq.bench generate --device cuda --layers 32 --batches 1,8 --repeat 2 --out "$work/generate.json"
  # engine (continuous batching) vs static batches of 8 vs transformers, fp16, hidden 1024, 8 layers,
  # 64 prompts (expected ~35 s)
  step engine 60 "$py" -m tritonq.bench engine --device cuda --num-prompts 64 --max-out 128 --skip prefix --out "$work/engine.json"
  # --- the rest, while the time allows ----------------------------------------------------------------
  # fp8 GEMM (block and channel scales) at M = 1, 16, 1024 vs torch bf16 (expected ~30 s)
  optional fp8 50 "$py" -m tritonq.bench fp8 --m 1,16,1024 --json "$work/fp8.json"
  # paged prefill / decode attention vs SDPA (expected ~30 s)
  optional attention 50 "$py" -m tritonq.bench attention --json "$work/attention.json"
  # fused MoE, DeepSeek-V2-Lite experts, 1 / 16 / 256 tokens (expected ~30 s)
  optional moe 50 "$py" -m tritonq.bench moe --tokens 1 16 256 --out "$work/moe.json"
  # load + AWQ repack of a 1 GiB checkpoint vs safe_open (expected ~20 s)
  optional load 40 "$py" -m tritonq.bench load --gb 1.0 --repeats 1 --json "$work/load.json"
  merge
}

# merge: one results.json from every step's exit status and JSON, and the check's counts
merge() {
  echo "=== [$(elapsed) s] merging into $out/results.json"
  timeout -s INT -k "$KILL" "$MERGE" "$py" - "$work" "$out" <<'PY'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])
results, failed = {"steps": {}}, []
for line in (work / "steps.tsv").read_text().splitlines():
    name, status, seconds, limit = line.split("\t")
    step = {"exit": status if status == "skipped" else int(status), "seconds": int(seconds), "limit": int(limit)}
    try:
        step["result"] = json.loads((work / f"{name}.json").read_text())
    except FileNotFoundError:
        step["result"] = None
    except ValueError as e:
        step["result"] = {"unreadable": str(e)}
    results["steps"][name] = step
    if status not in ("0", "skipped"):
        failed.append(f"{name} (exit {status})")
results["machine"] = results["steps"].get("machine", {}).get("result")
junit = out / "check.xml"
if junit.exists():
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    results["check"] = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
(out / "results.json").write_text(json.dumps(results, indent=1))
print("steps:", {name: step["exit"] for name, step in results["steps"].items()}, "check:", results.get("check"))
print("failed:", ", ".join(failed) if failed else "none")
sys.exit(1 if failed else 0)
PY
  local rc=$?
  echo "=== [$(elapsed) s] done (exit $rc)"
  return $rc
}


# STEP=tune: the launch configs tuned for this GPU (the narrowed sweep around the defaults, `tritonq.tune
# --near-default`, each run stopped by --budget and writing its best so far), then the benchmarks that use them.
# Shapes: the decode (M=1) and prefill (M=256) linears of Llama-2-7B, Llama-3-8B and Qwen3-8B (fused qkv and
# gate_up, as the runtime runs them) and Qwen3-30B-A3B's experts (128 experts, top 8, D=2048, I=768).
MOE_SHAPES=1x128x8x2048x768,256x128x8x2048x768
LLAMA_SHAPES=""
for m in 1 256; do
  for nk in 12288x4096 4096x4096 22016x4096 4096x11008 6144x4096 28672x4096 4096x14336 24576x4096 4096x12288; do
    LLAMA_SHAPES+="${LLAMA_SHAPES:+,}${m}x${nk}"
  done
done
tune_session() {
  step machine 20 "$py" -c "import torch; print(torch.cuda.get_device_name())"
  # the tune steps' limits add up to 240 s (tests/bench/test_gpu_session.py); each budget leaves ~20 s for imports
  step tune_int4 150 "$py" -m tritonq.tune --kernel int4_gemm --near-default --budget 125 --shapes "$LLAMA_SHAPES"
  step tune_moe 90 "$py" -m tritonq.tune --kernel moe --near-default --budget 70 --shapes "$MOE_SHAPES"
  mkdir -p "$out/configs"
  for kernel in int4_gemm moe; do
    if [ -d "tritonq/kernels/configs/$kernel" ]; then cp -r "tritonq/kernels/configs/$kernel" "$out/configs/"; fi
  done
  # the same benchmarks as the full session's, now with the tuned configs
  step int4_gemm 50 "$py" -m tritonq.bench int4_gemm --models llama-2-7b --m 1,2,4,8,16 --json "$work/int4_gemm.json"
  step moe 50 "$py" -m tritonq.bench moe --models qwen3-30b-a3b --weights int4 --tokens 1 16 256 --out "$work/moe.json"
  merge
}

case "${STEP:-all}" in
  all) session 2>&1 | tee "$out/session.log" ;;
  tune) tune_session 2>&1 | tee "$out/session.log" ;;
  *) echo "STEP=${STEP}: expected all (the default) or tune" >&2; exit 2 ;;
esac
