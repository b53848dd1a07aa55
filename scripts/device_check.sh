#!/usr/bin/env bash
# GPU check: compiles for the NVIDIA GPU found, compares the tiny model's logits with the CPU
# artifact's, and times decode and verify(k) on a DeepSeek-V4-shaped random model (tokens/s and the
# weight bandwidth reached, as a fraction of the device's copy bandwidth). Installs nothing: run it
# from an environment where ds4tvm is installed (PYTHON=/path/to/python to choose it). Prints a
# table; JSON goes to ${DEVICE_CHECK_OUT:-device_check.json}. Bounded to 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if ! command -v nvidia-smi > /dev/null 2>&1 || ! nvidia-smi -L 2> /dev/null | grep -q "^GPU"; then
    echo "device_check: no NVIDIA GPU on this machine (nvidia-smi absent or lists none): CPU-only, nothing to check"
    exit 0
fi
nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader
if ! "$PYTHON" -c "import ds4tvm, tvm" 2> /dev/null; then
    echo "device_check: $PYTHON cannot import ds4tvm and tvm; install the project first (pip install -e .)" >&2
    exit 2
fi
exec timeout 480 "$PYTHON" benchmarks/device_check.py --out "${DEVICE_CHECK_OUT:-device_check.json}" "$@"
