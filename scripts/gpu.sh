#!/usr/bin/env bash
# The GPU-side commands, one per measurement (results: benchmarks/results/README.md).
#   bash scripts/gpu.sh check   GPU tests (runtime + kernels)              -> results/gpu-tests/
#   bash scripts/gpu.sh ops     the kernel benchmark (benchmarks/bench_ops.py; ONLY=kernels, TOKENS=4096,16384,
#                                       NO_COMPILE=1, OPS_TIMEOUT=s: what finished in time is still collected)
#                                                                                   -> results/kernels/
#   bash scripts/gpu.sh bench   a benchmark suite (CASES=, `targets` by default; BUDGET=s to skip
#                                       the cases that would not fit)              -> results/<suite>/
#   bash scripts/gpu.sh capacity  the 14B capacity run and 8B with the disk tier (benchmarks/capacity.py)
#                                                                                   -> results/capacity/
#   bash scripts/gpu.sh capacity-master  8B with half the units' master and moments on disk
#   bash scripts/gpu.sh long    the tiled MLP's GPU tests, one block tiled and untiled (benchmarks/tiled_block.py:
#                                       the cost of 8,192-token tiles at 32,768 tokens, memory at 131,072 / 262,144), the
#                                       `long` ladders: 8B at 65,536 and 131,072 tokens, 3B at 131,072 and 262,144
#                                       (about 7 minutes; 10 if the planner admits 3B at 262,144; CASES= runs
#                                       one ladder)                                         -> results/long/
#   bash scripts/gpu.sh e2e     the CLI at 8B under a 24 GiB cap beside the harness's same shape, then the
#                                       crash / resume / export cycle at 3B (benchmarks/e2e.py) -> results/e2e/
# Writes logs and results under $OUT. Wheels in .whl/ (DeepSpeed and what it lacks, for an offline machine) are
# installed into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
COMMIT=${COMMIT:-unknown}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c "import torch, triton, transformers, lightning; print(torch.__version__, triton.__version__, transformers.__version__, lightning.__version__)" | tee -a "$OUT/machine.txt"

case "${1:-check}" in
  check)
    timeout 300 python3 -m pytest -q -m gpu tests/gpu tests/ops -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
    ;;
  ops)
    timeout "${OPS_TIMEOUT:-300}" python3 benchmarks/bench_ops.py --out /tmp/ops --commit "$COMMIT" \
      ${ONLY:+--only "$ONLY"} ${TOKENS:+--tokens "$TOKENS"} ${NO_COMPILE:+--no-compile} 2>&1 | tee "$OUT/bench_ops.log" | tail -40
    # every case that finished, as one JSON-lines file, and the plot drawn again from them (the timeout may
    # stop the run before it draws its own)
    python3 -c "import json,glob; print('\n'.join(json.dumps(json.load(open(f))) for f in sorted(glob.glob('/tmp/ops/*.json'))))" > "$OUT/ops_results.jsonl"
    python3 benchmarks/bench_ops.py --plot /tmp/ops >/dev/null 2>&1
    cp /tmp/ops/*.png "$OUT/" 2>/dev/null
    ;;
  capacity)
    timeout 330 python3 -m benchmarks.capacity --model qwen3_14b --steps 3 --micro-batch 8 --out "$OUT" \
      --commit "$COMMIT" 2>&1 | tail -40 > "$OUT/capacity-14b.log"; tail -15 "$OUT/capacity-14b.log"
    timeout 200 python3 -m benchmarks.capacity --model llama3_8b --steps 4 --micro-batch 8 --nvme-moments 0.1 \
      --activations nvme --out "$OUT" --commit "$COMMIT" 2>&1 | tail -40 > "$OUT/capacity-8b.log"; tail -15 "$OUT/capacity-8b.log"
    df -h /tmp | tee -a "$OUT/machine.txt"
    ;;
  capacity-master)
    timeout 300 python3 -m benchmarks.capacity --model llama3_8b --steps 3 --micro-batch 8 --nvme-moments 0.5 \
      --nvme-master --out "$OUT" --commit "$COMMIT" 2>&1 | tail -40 > "$OUT/capacity-8b-master.log"; tail -15 "$OUT/capacity-8b-master.log"
    ;;
  e2e)
    python3 -m benchmarks.run --cases llama3_8b-mb8-cap24-slide-cpu-clip1 --out "$OUT/harness" \
      --commit "$COMMIT" 2>&1 | tail -5
    python3 -m benchmarks.e2e --model llama3_8b --out "$OUT" --deadline-s 230 --commit "$COMMIT" 2>&1 | tail -3
    df -h /tmp | tee -a "$OUT/machine.txt"
    python3 -m benchmarks.e2e --model llama3_3b --crash --steps 12 --val-every 6 --out "$OUT" --deadline-s 200 \
      --commit "$COMMIT" 2>&1 | tail -3
    ;;
  long)
    timeout 150 python3 -m pytest -q tests/ops/test_tiled_mlp.py tests/ops/test_gpu.py -k tiled_mlp \
      -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_tiled.log" | tail -5
    timeout 200 python3 -m benchmarks.tiled_block --out "$OUT" 2>&1 | tail -8
    # the allocator's expandable segments: 8B at 131,072 tokens plans to within 0.4 GiB of the cap
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -m benchmarks.run --cases "${CASES:-long}" \
      --out "$OUT" --commit "$COMMIT"
    df -h /tmp | tee -a "$OUT/machine.txt"
    ;;
  bench)
    python3 -m benchmarks.run --cases "${CASES:-targets}" --out "$OUT" ${BUDGET:+--budget-s "$BUDGET"} --commit "$COMMIT"
    ;;
esac
