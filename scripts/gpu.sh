#!/usr/bin/env bash
# The GPU-side commands, one per measurement (results: benchmarks/results/README.md).
#   bash scripts/gpu.sh setup   the wheels below and machine.txt only (scripts/gpu_session.sh runs several commands)
#   bash scripts/gpu.sh check   every test marked gpu (runtime, kernels, Fabric) -> results/gpu-tests/
#   bash scripts/gpu.sh ops     the kernel benchmark (benchmarks/bench_ops.py; ONLY=kernels, TOKENS=4096,16384,
#                                       NO_COMPILE=1, OPS_TIMEOUT=s: what finished in time is still collected)
#                                                                                   -> results/kernels/
#   bash scripts/gpu.sh bench   a benchmark suite (CASES=, `targets` by default; BUDGET=s to skip
#                                       the cases that would not fit; ROUNDS=n to run them in turn n times
#                                       over)                                      -> results/<suite>/
#   bash scripts/gpu.sh capacity  the 14B capacity run and 8B with the disk tier (benchmarks/capacity.py)
#                                                                                   -> results/capacity/
#   bash scripts/gpu.sh capacity-master  8B with half the units' master and moments on disk
#   bash scripts/gpu.sh copies  copy rates by how a host buffer is page-locked: pin_memory, locked in place, and
#                                       locked in place over huge pages (benchmarks/pinned_copies.py) -> results/pinned-copies/
#   bash scripts/gpu.sh long    the tiled MLP's and grouped attention's GPU tests, one block tiled and untiled,
#                                       attention grouped and in one call (benchmarks/tiled_block.py: the cost of
#                                       8,192-token tiles at 32,768 tokens, memory at 131,072 / 262,144), the
#                                       `long` ladders: 8B at 65,536 and 131,072 tokens, 3B at 196,608 and 262,144
#                                       (about 7 minutes; CASES=llama3_3b-cap24-slide-cpu-tiles-auto-max-seq runs
#                                       the 3B one alone)                                   -> results/long/
#   bash scripts/gpu.sh compact  compact Adam moments against fp32: Llama-3.2-1B's shapes with 8 of its 16 blocks
#                                       (LAYERS=16 for all of them; at 4x512 tokens the CPU update binds each step)
#                                       on the built-in corpus, then fine-tuning, fp32 beside PRECISION=int8 (or
#                                       bf16, or int8-master24: 24-bit masters; one of them a call) (benchmarks/compact.py quality; STEPS=500,
#                                       FINETUNE_STEPS=80, LAYERS=8; PHASES=pretrain, or PHASES=finetune with
#                                       STEPS=200 for the fp32 run it continues, when both do not fit in a call)
#                                                                                   -> results/compact/
#   bash scripts/gpu.sh compact-capacity  the update's rate per moment_precision (CPU pool; GPU updater with and
#                                       without the code kernels), then 8B at 8x1024 on the RAM tier: VARIANTS= of
#                                       "fp32 int8 int8-clip" (peak host RSS per parameter, step time)
#   bash scripts/gpu.sh compact-scale  one model with 8-bit moments, 3 steps (benchmarks/capacity.py): MODEL=qwen3_14b
#                                       (or mistral_small_24b with OFFLOAD=nvme), MB=8 (or 64) x 1024 tokens,
#                                       TIMEOUT=s (570)
#                                                                                   -> results/compact/
#   bash scripts/gpu.sh desktop  a 64 GB desktop (a 64 GiB memory cgroup): `train.py` at 8B with 8-bit moments,
#                                       defaults but clipping off (CLIP=1.0 sets it): train with validation,
#                                       export and reload (benchmarks/e2e.py)                -> results/e2e/
#   bash scripts/gpu.sh e2e     the CLI at 8B under a 24 GiB cap beside the harness's same shape (benchmarks/e2e.py;
#                                       about 6 minutes)                                     -> results/e2e/
#   bash scripts/gpu.sh crash   the whole crash cycle at 1B (MODEL=llama3_3b DEADLINE=300 for 3B): the run
#                                       uninterrupted, then checkpoint, SIGKILL, resume, export and reload, the
#                                       resumed losses beside the uninterrupted ones         -> results/e2e/
#   bash scripts/gpu.sh packing  packed against padded SFT batches at 1B, seq 2048 (benchmarks/packing.py;
#                                       MODEL= another architecture)                -> results/packing/
# Writes logs and results under $OUT. Wheels in .whl/ are installed into /tmp/site first, for an offline machine:
# DeepSpeed and what it lacks, hydra-core/omegaconf/antlr4 for train.py, and kvikio-cu13, libkvikio-cu13,
# rapids-logger, nvidia-cufile and cuda-pathfinder for the disk tier's direct I/O (without them `check` skips the
# tests that ask for gds='on').
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" >/dev/null; then
  wheels=$(ls .whl/*.whl | md5sum)  # installed once per machine and set of wheels
  if [[ $(cat /tmp/site/.wheels 2>/dev/null) != "$wheels" ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && echo "$wheels" > /tmp/site/.wheels
  fi
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
COMMIT=${COMMIT:-unknown}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c "import torch, triton, transformers, lightning; print(torch.__version__, triton.__version__, transformers.__version__, lightning.__version__)" | tee -a "$OUT/machine.txt"

case "${1:-check}" in
  setup)  # the wheels and machine.txt only
    ;;
  check)
    timeout 300 python3 -m pytest -q -rs -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
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
  desktop)
    # A 64 GB desktop: every process of the run in a memory cgroup limited to 64 GiB (v2, else v1), which the
    # planner reads as the machine's RAM; the CLI at 8B with 8-bit moments trains, exports, reloads
    if mkdir -p /sys/fs/cgroup/desktop64 2>/dev/null && echo $((64 << 30)) > /sys/fs/cgroup/desktop64/memory.max; then
      procs=/sys/fs/cgroup/desktop64/cgroup.procs
    elif mkdir -p /sys/fs/cgroup/memory/desktop64 2>/dev/null \
        && echo $((64 << 30)) > /sys/fs/cgroup/memory/desktop64/memory.limit_in_bytes; then
      procs=/sys/fs/cgroup/memory/desktop64/cgroup.procs
    else
      echo "no writable memory cgroup on this machine" | tee "$OUT/desktop.log"; exit 1
    fi
    (echo $BASHPID > "$procs" && exec python3 -m benchmarks.e2e --model llama3_8b --steps "${STEPS:-6}" \
      --val-every 3 --override offload.moment_precision=int8 --override "trainer.gradient_clip_val=${CLIP:-null}" \
      --name "e2e-llama3_8b-int8-ram64${CLIP:+-clip}" --out "$OUT" --deadline-s 500 --commit "$COMMIT") 2>&1 \
      | tail -3 > "$OUT/desktop.log"; tail -3 "$OUT/desktop.log"
    ;;
  e2e)
    python3 -m benchmarks.run --cases llama3_8b-mb8-cap24-slide-cpu-clip1 --out /tmp/e2e-harness \
      --commit "$COMMIT" 2>&1 | tail -5
    cp /tmp/e2e-harness/results.jsonl "$OUT/harness-results.jsonl"
    python3 -m benchmarks.e2e --model llama3_8b --out "$OUT" --deadline-s 230 --commit "$COMMIT" 2>&1 | tail -3
    df -h /tmp | tee -a "$OUT/machine.txt"
    ;;
  crash)
    python3 -m benchmarks.e2e --model "${MODEL:-llama3_1b}" --crash --steps 12 --val-every 6 --out "$OUT" \
      --deadline-s "${DEADLINE:-420}" --commit "$COMMIT" 2>&1 | tail -3
    ;;
  packing)
    timeout 300 python3 -m benchmarks.packing --model "${MODEL:-llama3_1b}" --out "$OUT" --commit "$COMMIT" 2>&1 \
      | tail -60 > "$OUT/packing.log"; tail -20 "$OUT/packing.log"
    ;;
  copies)
    timeout 120 python3 -m benchmarks.pinned_copies --out "$OUT" 2>&1 | tee "$OUT/pinned_copies.log"
    ;;
  long)
    timeout 150 python3 -m pytest -q tests/ops/test_tiled_mlp.py tests/ops/test_grouped_attention.py \
      tests/ops/test_gpu.py -k "tiled_mlp or attention" -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_tiled.log" | tail -5
    timeout 200 python3 -m benchmarks.tiled_block --out "$OUT" 2>&1 | tail -8
    # the allocator's expandable segments: 8B at 131,072 tokens plans to within 0.4 GiB of the cap
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -m benchmarks.run --cases "${CASES:-long}" \
      --out "$OUT" --commit "$COMMIT"
    df -h /tmp | tee -a "$OUT/machine.txt"
    ;;
  compact)
    timeout 590 python3 -m benchmarks.compact quality --precisions ${PRECISION:-int8} \
      --phases ${PHASES:-pretrain finetune} --steps "${STEPS:-500}" --finetune-steps "${FINETUNE_STEPS:-80}" \
      --layers "${LAYERS:-8}" --out "$OUT" --commit "$COMMIT" 2>&1 \
      | grep -v Warning | tail -60 > "$OUT/compact.log"
    tail -40 "$OUT/compact.log"
    ;;
  compact-capacity)
    timeout 100 python3 -m benchmarks.compact update --threads 1 4 8 16 --pieces 262144 --out "$OUT" \
      --commit "$COMMIT" 2>&1 | tail -8
    for variant in ${VARIANTS:-fp32 int8 int8-clip}; do
      case $variant in
        *-clip) set -- "${variant%-clip}" --clip 1.0 ;;
        *) set -- "$variant" ;;
      esac
      timeout 160 python3 -m benchmarks.capacity --model llama3_8b --offload cpu --steps 4 --micro-batch 8 \
        --moment-precision "$@" --out "$OUT" --commit "$COMMIT" 2>&1 | tail -40 > "$OUT/capacity-8b-$variant.log"
      tail -14 "$OUT/capacity-8b-$variant.log"
    done
    ;;
  compact-scale)
    timeout "${TIMEOUT:-570}" python3 -m benchmarks.capacity --model "${MODEL:-qwen3_14b}" --offload "${OFFLOAD:-cpu}" --steps 3 \
      --micro-batch "${MB:-8}" --moment-precision int8 --out "$OUT" --commit "$COMMIT" 2>&1 | tail -40 \
      > "$OUT/capacity-${MODEL:-qwen3_14b}-int8-mb${MB:-8}.log"; tail -14 "$OUT/capacity-${MODEL:-qwen3_14b}-int8-mb${MB:-8}.log"
    df -h /tmp | tee -a "$OUT/machine.txt"
    ;;
  bench)
    python3 -m benchmarks.run --cases "${CASES:-targets}" --out "$OUT" ${BUDGET:+--budget-s "$BUDGET"} \
      ${ROUNDS:+--rounds "$ROUNDS"} --commit "$COMMIT"
    ;;
  *)
    echo "scripts/gpu.sh: no command '$1' (the commands are listed at the top of the script)" >&2; exit 2
    ;;
esac
