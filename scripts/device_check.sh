#!/usr/bin/env bash
# The GPU check (benchmarks/device_check.py), bounded to 8 minutes. Three ways to run it:
#   scripts/device_check.sh                where ds4tvm and TVM's compiler are installed and an
#                                          NVIDIA GPU is: prepare for the GPU found, then check;
#   scripts/device_check.sh --packed DIR   on a GPU machine with Python only: DIR is what
#                                          scripts/device_pack.sh built (its code, TVM's runtime and
#                                          the prepared artifacts), nothing is installed;
#   scripts/device_check.sh --cpu          the same steps on this CPU: tiny models of the three
#                                          families, their GPU forms built for llvm (what the
#                                          default test run exercises).
# Prints a table; the JSON goes to ${DEVICE_CHECK_OUT:-device_check.json}. Exit status: 0 when every
# logit is within its limit of the CPU's (1e-4; GLM-5.3 2e-4) and every greedy token equal, 1 when
# not, 2 when it cannot run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
OUT_JSON="${DEVICE_CHECK_OUT:-device_check.json}"
LIMIT=480

has_gpu() { command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi -L 2> /dev/null | grep -q "^GPU"; }

case "${1:-}" in
    --packed)
        PACK="${2:?--packed needs the directory scripts/device_pack.sh built}/pack.tar.xz"
        [ -f "$PACK" ] || { echo "device_check: $PACK: no such file (build it with scripts/device_pack.sh)" >&2; exit 2; }
        has_gpu && nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader
        DIR="$(mktemp -d)"
        trap 'rm -rf "$DIR"' EXIT
        tar -xJf "$PACK" -C "$DIR"
        echo "device_check: unpacked $(cat "$DIR/pack.json")"
        env PYTHONPATH="$DIR/code:$DIR/site" TVM_USE_RUNTIME_LIB=1 timeout "$LIMIT" \
            "$PYTHON" "$DIR/code/benchmarks/device_check.py" check "$DIR/prepared" --out "$OUT_JSON" ;;
    --cpu)
        WORK="$(mktemp -d)"
        trap 'rm -rf "$WORK"' EXIT
        timeout "$LIMIT" "$PYTHON" benchmarks/device_check.py selftest "$WORK" --out "$OUT_JSON" ;;
    "")
        if ! has_gpu; then
            echo "device_check: no NVIDIA GPU on this machine (nvidia-smi absent or lists none); --cpu runs the same steps on this CPU"
            exit 0
        fi
        nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader
        if ! "$PYTHON" -c "import ds4tvm, tvm" 2> /dev/null; then
            echo "device_check: $PYTHON cannot import ds4tvm and tvm; install the project first (pip install -e .)" >&2
            exit 2
        fi
        ARCH="sm_$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')"
        WORK="$(mktemp -d)"
        trap 'rm -rf "$WORK"' EXIT
        timeout "$LIMIT" bash -c "\"$PYTHON\" benchmarks/device_check.py prepare \"$WORK\" --arch $ARCH &&
            \"$PYTHON\" benchmarks/device_check.py check \"$WORK\" --out \"$OUT_JSON\"" ;;
    *)
        echo "device_check: unknown option $1 (--packed DIR, --cpu, or none)" >&2
        exit 2 ;;
esac
