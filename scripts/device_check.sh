#!/usr/bin/env bash
# GPU check (benchmarks/device_check.py): builds the demo DeepSeek-V4 + DSpark pair and two larger
# random DeepSeek-V4-shaped models (0.5 and 4.7 GB read per decode step) for the NVIDIA GPU found,
# compares the GPU's logits and greedy DSpark tokens with the CPU's, and times prefill, decode and verify(k) (tokens/s, and the weight
# bandwidth reached as a fraction of the device's copy bandwidth). Installs nothing: run it where
# ds4tvm and TVM are installed (PYTHON=/path/to/python to choose). Prints a table; JSON goes to
# ${DEVICE_CHECK_OUT:-device_check.json}. Bounded to 9.5 minutes.
# On a GPU machine that has TVM's runtime only, run the phases apart: `device_check.py prepare DIR
# --arch sm_XX` on a machine with TVM's compiler, then `device_check.py check DIR` on the GPU machine.
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
ARCH="sm_$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
timeout 570 bash -c "\"$PYTHON\" benchmarks/device_check.py prepare \"$WORK\" --arch $ARCH &&
    \"$PYTHON\" benchmarks/device_check.py check \"$WORK\" --out \"${DEVICE_CHECK_OUT:-device_check.json}\" $*"
