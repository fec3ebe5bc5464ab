#!/usr/bin/env bash
# The test suite on a CPU machine, as CI runs it (.ci/run is this script with VENV=/tmp/ci-venv):
#   bash scripts/test.sh [pytest arguments]
# 1. a venv at $VENV (default .venv) with the package and its dev extra; the constraints file keeps pip on the
#    CPU build of torch;
# 2. ruff check, with the rules in pyproject.toml: any violation stops the run (ruff format is configured there
#    too, but the tree keeps its own line wrapping, so it is not checked);
# 3. kvikio for the disk tier's tests, without its 1.7 GB of CUDA libraries, and a stand-in libcuda.so.1 built
#    from tests/support/fake_libcuda.c (kvikio asks the driver about every buffer; the stand-in answers "host
#    memory"), only where no real driver is installed: it would hide the GPU;
# 4. pytest, offline. The exit status is ruff's when it finds violations, else pytest's: non-zero on any failure,
#    5 when no test was collected.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q -c constraints-cpu.txt -e '.[dev]'
"$VENV/bin/ruff" check .
if /sbin/ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 '; then
  echo "scripts/test.sh: a CUDA driver is installed, so no stand-in libcuda; the disk tier's kvikio tests run" \
       "with kvikio from pip install -e '.[nvme]' and skip without it" >&2
else
  "$VENV/bin/pip" install -q --no-deps kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 cuda-toolkit==13.5.0 \
      nvidia-cufile==1.20.0.107 cuda-pathfinder==1.9.1 rapids-logger==0.3.0
  stub="$(cd "$VENV" && pwd)/fake-cuda"
  mkdir -p "$stub"
  gcc -shared -fPIC -O2 -Wl,-soname,libcuda.so.1 -o "$stub/libcuda.so.1" tests/support/fake_libcuda.c
  export KVIKIO_COMPAT_MODE=ON LD_LIBRARY_PATH="$stub${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "$VENV/bin/python" -m pytest -q "$@"
