"""The CPU linears of every GGUF format, one kernel at a time: the hand-written kernels of
nn/cpu_kernels.py side by side with the TE kernels that schedules/llvm.py builds for the same
linear, in one run. Prints ms per call and the weight bytes read per second (GB/s: the bytes of
the experts a call uses, or of the whole matrix) at one token (decode) and at --tokens (prefill).

    python benchmarks/cpu_kernels.py [--types q8_0,q4_k,q2_k,iq2_xxs,mxfp4] [--shape 16,512,512,4]
        [--tokens 64] [--threads 2] [--no-int8]

--shape is E,N,K,J: E experts of N x K weights, J chosen per token (the benchmark model's routed
gate/up by default); the dense linear is one N*E/4 x K matrix."""

from __future__ import annotations

import argparse
import os

import numpy as np
import tvm
from gguf import GGMLQuantizationType as QT
from tvm import relax
from tvm.relax.frontend import nn

from ds4tvm.gguf.quant import random_blocks, to_planes
from ds4tvm.nn import cpu_kernels
from ds4tvm.nn.qweight import QWeight, for_cpu
from ds4tvm.schedules.llvm import pipeline


def build(qtype: QT, E: int, N: int, K: int, J: int, threads: int, kernel: str):
    class M(nn.Module):
        def __init__(self):
            self.w = QWeight("w", qtype, (N * E // 4, K))
            self.we = QWeight("we", qtype, (E, N, K))

        def dense(self, x):
            return self.w.linear(x)

        def experts(self, x, sel):
            return self.we.expert_linear(x, sel)

    mode = {"param_mode": "plain", "effect_mode": "none"}
    spec = {"dense": {"x": nn.spec.Tensor(["t", K], "float32"), "$": mode},
            "experts": {"x": nn.spec.Tensor(["t", K], "float32"), "sel": nn.spec.Tensor(["t", J], "int32"), "$": mode}}
    if kernel != "TE":
        with for_cpu(threads, int8_activations=kernel == "int8"):
            mod, params = M().export_tvm(spec=spec)
    else:
        mod, params = M().export_tvm(spec=spec)
    target = tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu(), "num-cores": threads})
    return relax.VirtualMachine(tvm.compile(mod, target=target, relax_pipeline=pipeline(target)), tvm.cpu()), params


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="q8_0,q4_k,q2_k,q6_k,q4_1,mxfp4,iq2_xxs")
    ap.add_argument("--shape", default="16,512,512,4")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--int8", action=argparse.BooleanOptionalAction, default=True,
                    help="also the int8-activation kernels (--int8-activations; needs AVX-512 VNNI)")
    a = ap.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(a.threads)   # TVM's default counts x86 cores as hyperthread pairs
    E, N, K, J = (int(v) for v in a.shape.split(","))
    rng = np.random.default_rng(0)
    print(f"E={E} N={N} K={K} J={J}, dense {N * E // 4}x{K}, {a.threads} threads; ms per call (GB/s of weights)")
    print(f"| type | kernel | dense 1 | experts 1 | dense {a.tokens} | experts {a.tokens} | experts 1: TE / this |")
    print("|---|---|---|---|---|---|---|")
    for name in a.types.split(","):
        qtype = QT[name.upper()]
        shapes = {"w": (N * E // 4, K), "we": (E, N, K)}
        raw = {o: random_blocks(qtype, s, rng) for o, s in shapes.items()}
        planes = {o: to_planes(raw[o], qtype, s) for o, s in shapes.items()}
        nbytes = {o: sum(v.nbytes for v in planes[o].fields.values()) for o in shapes}
        times = {}
        kernels = ["int8", "hand", "TE"] if a.int8 and cpu_kernels.takes_int8(qtype, K) else ["hand", "TE"]
        for kernel in kernels:
            vm, params = build(qtype, E, N, K, J, a.threads, kernel)
            args = [tvm.runtime.tensor(np.ascontiguousarray(planes[n.split(".")[0]].fields[n.split("plane_")[1]]))
                    for n, _ in params]
            row = []
            for T in (1, a.tokens):
                x = tvm.runtime.tensor(rng.standard_normal((T, K)).astype(np.float32))
                sel_np = np.stack([rng.choice(E, J, replace=False) for _ in range(T)]).astype(np.int32)
                sel = tvm.runtime.tensor(sel_np)
                used = len(np.unique(sel_np))
                vm["dense"](x, *args), vm["experts"](x, sel, *args)   # warm up: thread pool, first-touch pages
                dense = vm.time_evaluator("dense", tvm.cpu(), number=20, repeat=a.repeat)(x, *args)
                exp = vm.time_evaluator("experts", tvm.cpu(), number=20, repeat=a.repeat)(x, sel, *args)
                row += [(dense.median, nbytes["w"]), (exp.median, nbytes["we"] * used / E)]
            times[kernel] = row
        for kernel in kernels:
            cells = " | ".join(f"{t * 1e3:.3f} ({b / t / 1e9:.1f})" for t, b in times[kernel])
            ratio = f"{times['TE'][1][0] / times[kernel][1][0]:.1f}x" if kernel != "TE" else ""
            print(f"| {qtype.name} | {kernel} | {cells} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
