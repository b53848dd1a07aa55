"""The CPU linears of every GGUF format, one kernel at a time: the hand-written kernels of
kernels/cpu.py side by side with the TE kernels that schedules/llvm.py builds for the same
linear, in one run. Prints ms per call and the weight bytes read per second (GB/s: the bytes of
the experts a call uses, or of the whole matrix) at one token (decode) and at --tokens (prefill).

    python benchmarks/cpu_kernels.py [--types q8_0,q4_k,q2_k,iq2_xxs,mxfp4] [--shape 16,512,512,4]
        [--tokens 64] [--threads 2] [--no-int8] [--blockings 4x6,2x2] [--cold 40]

--shape is E,N,K,J: E experts of N x K weights, J chosen per token (the benchmark model's routed
gate/up by default); the dense linear is one N*E/4 x K matrix. --blockings times the hand kernels in each register
blocking given (ROWSxTOKENS, kernels/cpu.Blocking) side by side; by default the one this CPU
takes. --cold COPIES reads the weights from memory, as decode does (the default reads them from
the cache). The int8 kernels take the CPU's dot instruction (AVX-512 VNNI's or AVX2's). The one-token
columns time the kernels decode exports (a static token count of 1: rows one at a time,
kernels/forms.py), the others those of any token count."""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import tvm
from gguf import GGMLQuantizationType as QT
from tvm import relax
from tvm.relax.frontend import nn

from ds4tvm.gguf.quant import derived_plane, random_blocks, to_planes
from ds4tvm.kernels import cpu as cpu_kernels
from ds4tvm.kernels.forms import TE, CpuLinears, Forms
from ds4tvm.nn.qweight import QWeight, parameter_sources, set_forms
from ds4tvm.runtime.threads import SPIN_COUNT
from ds4tvm.schedules.llvm import pipeline


def build(qtype: QT, E: int, N: int, K: int, J: int, threads: int, kernel: str, blocking=None, static=(1,)):
    """(VM, weight-binding function planes -> arguments) of the dense and expert linears of one
    format; kernel: TE, hand, int8 (the default layout: Q8_0 interleaved on AVX-512 VNNI) or
    int8-rows (the row-major int8 kernel of kernels/cpu.py). `dense`/`experts` take a run-time
    number of tokens, `dense{s}`/`experts{s}` a static s for each s of `static` (a decode's 1, a
    batched decode's rows)."""
    class M(nn.Module):
        def __init__(self):
            self.w = QWeight("w", qtype, (N * E // 4, K))
            self.we = QWeight("we", qtype, (E, N, K))

        def dense(self, x):
            return self.w.linear(x)

        def experts(self, x, sel):
            return self.we.expert_linear(x, sel)

    counts = [("", "t")] + [(str(t), t) for t in static]   # static rows, as decode exports them (kernels/forms.py)
    for suffix, _ in counts[1:]:
        setattr(M, f"dense{suffix}", M.dense)
        setattr(M, f"experts{suffix}", M.experts)
    mode = {"param_mode": "plain", "effect_mode": "none"}
    spec = {f"dense{s}": {"x": nn.spec.Tensor([t, K], "float32"), "$": mode} for s, t in counts}
    spec.update({f"experts{s}": {"x": nn.spec.Tensor([t, K], "float32"), "sel": nn.spec.Tensor([t, J], "int32"),
                                 "$": mode} for s, t in counts})
    target = tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu(), "num-cores": threads})
    forms = TE if kernel == "TE" else Forms(cpu_linears=CpuLinears(
        threads, blocking or cpu_kernels.blocking_for(target),
        cpu_kernels.int8_dot_for(target) if kernel.startswith("int8") else None, interleaved=kernel != "int8-rows"))
    model = set_forms(M(), forms)
    sources = parameter_sources(model)
    mod, params = model.export_tvm(spec=spec)

    def bind(planes: dict) -> list:   # {"w": Planes, "we": Planes} -> the arguments, as the runtime derives them
        return [tvm.runtime.tensor(np.ascontiguousarray(derived_plane(planes[sources[id(p)][0]], sources[id(p)][1])))
                for _, p in params]

    return relax.VirtualMachine(tvm.compile(mod, target=target, relax_pipeline=pipeline(target)), tvm.cpu()), bind


def _seconds_per_call(vm, fn: str, inputs: list, copies: list) -> float:
    """One copy of the weights: TVM's time_evaluator (warm caches); several: each in turn, so that
    every call finds its weights evicted by the others."""
    for args in copies:
        vm[fn](*inputs, *args)   # warm: thread pool, first-touch pages
    if len(copies) == 1:
        return vm.time_evaluator(fn, tvm.cpu(), number=20, repeat=1)(*inputs, *copies[0]).mean
    f, rounds = vm[fn], max(1, 60 // len(copies))
    t0 = time.perf_counter()
    for _ in range(rounds):
        for args in copies:
            f(*inputs, *args)
    return (time.perf_counter() - t0) / (rounds * len(copies))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="q8_0,q4_k,q2_k,q6_k,q4_1,mxfp4,iq2_xxs")
    ap.add_argument("--shape", default="16,512,512,4")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--int8", action=argparse.BooleanOptionalAction, default=True,
                    help="also the int8-activation kernels (--int8-activations; AVX-512 VNNI or AVX2)")
    ap.add_argument("--blockings", default="", help="register blockings ROWSxTOKENS of the hand kernels, e.g. 4x6,2x2")
    ap.add_argument("--cold", type=int, default=0, metavar="COPIES",
                    help="call each kernel on COPIES copies of its weights in turn (more than the last-level "
                         "cache holds): weights read from memory, as in a model's decode")
    a = ap.parse_args()
    system = tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})
    dot = cpu_kernels.int8_dot_for(system)
    blockings = [cpu_kernels.Blocking(*map(int, b.split("x"))) for b in a.blockings.split(",") if b] or \
        [cpu_kernels.blocking_for(system)]
    os.environ["TVM_NUM_THREADS"] = str(a.threads)   # TVM's default counts x86 cores as hyperthread pairs
    os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", SPIN_COUNT)   # the engine's pool (runtime/threads.py)
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
        kernels = [("int8", "int8", blockings[0])] if a.int8 and dot and cpu_kernels.takes_int8(qtype, K, dot) else []
        if kernels and qtype == QT.Q8_0 and dot == "vpdpbusd":
            kernels.append(("int8 rows", "int8-rows", blockings[0]))   # the row-major layout
        kernels += [(f"hand {b.rows}x{b.tokens}", "hand", b) for b in blockings] + [("TE", "TE", None)]
        built = {}
        for label, kernel, blocking in kernels:
            vm, bind = build(qtype, E, N, K, J, a.threads, kernel, blocking)
            built[label] = vm, [bind(planes) for _ in range(max(1, a.cold))]
        cases = []   # (function, inputs, bytes read)
        for T in (1, a.tokens):
            x = tvm.runtime.tensor(rng.standard_normal((T, K)).astype(np.float32))
            sel_np = np.stack([rng.choice(E, J, replace=False) for _ in range(T)]).astype(np.int32)
            used = len(np.unique(sel_np))
            one = "1" if T == 1 else ""
            cases += [(f"dense{one}", [x], nbytes["w"]),
                      (f"experts{one}", [x, tvm.runtime.tensor(sel_np)], nbytes["we"] * used / E)]
        samples = {label: [[] for _ in cases] for label in built}
        for _ in range(a.repeat):   # the kernels alternate, so the machine's drift falls on all of them
            for label, (vm, copies) in built.items():
                for i, (fn, inputs, _) in enumerate(cases):
                    samples[label][i].append(_seconds_per_call(vm, fn, inputs, copies))
        times = {label: [float(np.median(s)) for s in rows] for label, rows in samples.items()}
        for label in built:
            cells = " | ".join(f"{t * 1e3:.3f} ({c[2] / t / 1e9:.1f})" for t, c in zip(times[label], cases))
            ratio = f"{times['TE'][1] / times[label][1]:.1f}x" if label != "TE" else ""
            print(f"| {qtype.name} | {label} | {cells} | {ratio} |", flush=True)

if __name__ == "__main__":
    main()
