"""int8 linears in both layouts, side by side in one run: the row-major int8 kernel of
kernels/cpu.py and kernels/cpu_interleaved.py's 16 rows interleaved (the default on AVX-512 VNNI),
at the token counts of a decode, batched decodes, verify and prefill, for a dense matrix and for
routed experts. Weights in the cache by default; --cold COPIES reads them from memory.

    python benchmarks/int8_interleaved.py [--types q8_0,q4_k,q2_k,iq2_xxs,mxfp4] [--shape 16,512,512,4]
        [--tokens 1,2,4,8,64,256] [--threads 2] [--cold 0]

--shape is E,N,K,J as in benchmarks/cpu_kernels.py (the dense matrix is N*E/4 x K: 2048 x 512 by
default; 32768,512 for E,N gives the benchmark model's output head as the dense one)."""

from __future__ import annotations

import argparse
import os

import numpy as np
import tvm
from gguf import GGMLQuantizationType as QT

from cpu_kernels import _seconds_per_call, build
from ds4tvm.gguf.quant import random_blocks, to_planes
from ds4tvm.runtime.threads import SPIN_COUNT

LAYOUTS = {"rows": "int8-rows", "interleaved": "int8"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="q8_0,q4_k,q2_k,iq2_xxs,mxfp4")
    ap.add_argument("--shape", default="16,512,512,4")
    ap.add_argument("--tokens", default="1,2,4,8,64,256")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cold", type=int, default=0, metavar="COPIES")
    a = ap.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(a.threads)
    os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", SPIN_COUNT)
    if not tvm.target.codegen.target_has_features(
            "avx512vnni", tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})):
        raise SystemExit("this CPU has no AVX-512 VNNI: the interleaved kernels are not built for it")
    E, N, K, J = (int(v) for v in a.shape.split(","))
    print(f"dense {N * E // 4} x {K}, experts {E} x {N} x {K} ({J} chosen), {a.threads} threads, "
          f"{'weights from memory' if a.cold else 'weights in the cache'}; us per call (GMAC/s)")
    print("| type | tokens | linear | row-major int8 | interleaved | speed-up |")
    print("|---|---|---|---|---|---|")
    for name in a.types.split(","):
        compare(QT[name.upper()], E, N, K, J, a)


def compare(qtype: QT, E: int, N: int, K: int, J: int, a) -> None:
    rng = np.random.default_rng(0)
    shapes = {"w": (N * E // 4, K), "we": (E, N, K)}
    planes = {o: to_planes(random_blocks(qtype, s, rng), qtype, s) for o, s in shapes.items()}
    built = {}
    for label, kernel in LAYOUTS.items():
        vm, bind = build(qtype, E, N, K, J, a.threads, kernel)
        built[label] = vm, [bind(planes) for _ in range(max(1, a.cold))]
    cases = []
    for t in (int(v) for v in a.tokens.split(",")):
        x = tvm.runtime.tensor(rng.standard_normal((t, K)).astype(np.float32))
        sel = tvm.runtime.tensor(np.stack([rng.choice(E, J, replace=False) for _ in range(t)]).astype(np.int32))
        one = "1" if t == 1 else ""   # decode's static one-token functions
        cases += [(t, "dense", f"dense{one}", [x]), (t, "experts", f"experts{one}", [x, sel])]
    samples = {label: [[] for _ in cases] for label in built}
    for _ in range(a.repeat):   # alternated, so the machine's drift falls on both
        for label, (vm, copies) in built.items():
            for i, (_, _, fn, inputs) in enumerate(cases):
                samples[label][i].append(_seconds_per_call(vm, fn, inputs, copies))
    med = {label: [float(np.median(s)) for s in rows] for label, rows in samples.items()}
    for i, (t, kind, _, _) in enumerate(cases):
        macs = t * K * (N * E // 4 if kind == "dense" else N * J)
        r, il = med["rows"][i], med["interleaved"][i]
        print(f"| {qtype.name} | {t} | {kind} | {r * 1e6:.1f} ({macs / r / 1e9:.0f}) | {il * 1e6:.1f} "
              f"({macs / il / 1e9:.0f}) | {r / il:.2f}x |", flush=True)

if __name__ == "__main__":
    main()
