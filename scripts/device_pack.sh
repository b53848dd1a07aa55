#!/usr/bin/env bash
# Everything the GPU check needs, in one directory to carry to a GPU machine that has Python but
# no TVM: `scripts/device_pack.sh OUT [--arch sm_90] [--device cuda|cpu] [--python-version 3.12]`.
# OUT/pack.tar.xz holds
#   prepared/  benchmarks/device_check.py prepare's artifacts and CPU references (the timed models'
#              GGUFs are written again on the device from their seeds);
#   code/      this checkout's ds4tvm, benchmarks and scripts (the embedded demo pair included);
#   site/      the installed apache-tvm, apache-tvm-ffi, gguf and numpy versions (and what they
#              import) for the device's Python, as pip installs them with --target, less TVM's
#              compiler library, headers and third-party sources: the runtime alone.
# On the device: `scripts/device_check.sh --packed OUT` (from any checkout: it unpacks OUT into a
# temporary directory and runs its code/).
# --device cpu packs the CPU plan (tiny models, GPU forms for llvm) to try the pack where there is
# no GPU. Fails when OUT would exceed 60 MiB (the device tool carries 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: scripts/device_pack.sh OUT [--arch sm_90] [--device cuda|cpu] [--python-version 3.12]}"
shift
ARCH=sm_90 DEVICE=cuda PYVER=3.12
while [ $# -gt 0 ]; do
    case "$1" in
        --arch) ARCH="$2"; shift 2 ;;
        --device) DEVICE="$2"; shift 2 ;;
        --python-version) PYVER="$2"; shift 2 ;;
        *) echo "device_pack: unknown option $1" >&2; exit 2 ;;
    esac
done
PYTHON="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
if [ -e "$OUT" ] && [ -n "$(ls -A "$OUT" 2> /dev/null)" ]; then
    echo "device_pack: $OUT exists and is not empty; give a new directory" >&2
    exit 2
fi
mkdir -p "$OUT"
TREE="$(mktemp -d)"
trap 'rm -rf "$TREE"' EXIT
start=$(date +%s)
"$PYTHON" benchmarks/device_check.py prepare "$TREE/prepared" --device "$DEVICE" --arch "$ARCH"
prepared=$(date +%s)

# the code as it is in this checkout (tracked and new files, not ignored ones)
git ls-files -co --exclude-standard -- ds4tvm benchmarks scripts pyproject.toml | tar -cf - -T - | tar -xf - -C "$TREE" --one-top-level=code

# TVM's runtime and what the check imports, for the device's Python
version() { "$PYTHON" -c "import importlib.metadata as m; print(m.version('$1'))"; }
pip_target() {
    "$PYTHON" -m pip install --quiet --target "$TREE/site" --python-version "$PYVER" --only-binary=:all: "$@"
}
pip_target --no-deps "apache-tvm==$(version apache-tvm)" "apache-tvm-ffi==$(version apache-tvm-ffi)" \
    "ml_dtypes==$(version ml_dtypes)" "typing_extensions==$(version typing_extensions)" \
    "numpy==$(version numpy)" "gguf==$(version gguf)" "pyyaml==$(version pyyaml)" "tqdm==$(version tqdm)"
tvm="$TREE/site/tvm" ffi="$TREE/site/tvm_ffi"
rm -rf "$tvm/lib/libtvm_compiler.so" "$tvm/3rdparty" "$tvm/include" "$tvm/src" "$tvm/web" "$tvm/lib64" \
    "$ffi/include" "$ffi/3rdparty" "$TREE/site/bin"
find "$TREE" -name __pycache__ -type d -prune -exec rm -rf {} +
echo "{\"device\": \"$DEVICE\", \"arch\": \"$ARCH\", \"python\": \"$PYVER\", \"commit\": \"$(git rev-parse HEAD)\"}" > "$TREE/pack.json"
tar -cJf "$OUT/pack.tar.xz" -C "$TREE" pack.json prepared code site
size=$(du -sb "$OUT" | cut -f1)
echo "device_pack: $OUT holds $((size / 1048576)) MiB ($(du -sm "$TREE/prepared" | cut -f1) MiB prepared, $(du -sm "$TREE/code" | cut -f1) code, $(du -sm "$TREE/site" | cut -f1) site before xz); prepare took $((prepared - start)) s, packing $(($(date +%s) - prepared)) s"
if [ "$size" -gt $((60 * 1048576)) ]; then
    echo "device_pack: $OUT is over 60 MiB" >&2
    exit 1
fi
