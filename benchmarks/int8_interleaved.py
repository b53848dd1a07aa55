"""An experiment, not used by the compiler: a Q8_0 int8 linear whose weights are repacked with 16
rows interleaved, so that one vpdpbusd (AVX-512 VNNI) multiplies 4 weights of each of 16 rows by
4 inputs broadcast to every lane, and one int32 sum per 32-weight block and row needs one
conversion and one multiply-add for 16 rows (ik_llama.cpp's row-interleaved layouts); against
kernels/cpu.py's int8 kernel (a conversion, a multiply and a multiply-add per 64 weights per row
and token), at a few tokens: what batched decodes and verify run. Checks the prototype's sums
against numpy first. Usage (a CPU with AVX-512 VNNI):
    python benchmarks/int8_interleaved.py [--rows 2048] [--cols 512] [--tokens 1,2,4,8] [--threads 2]

Layout: codes [N/16, K/32, 8, 16 rows x 4 bytes] (signed, as stored), scales [N/16, K/32, 16]
float32, and per row and block 128 x the sum of its codes: the inputs are made unsigned (+128, the
operand vpdpbusd takes unsigned), so each sum is corrected by that much."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import tvm
from gguf import GGMLQuantizationType as QT
from tvm import tirx
from tvm.script import tirx as T

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _ramp(n: int, start=0):
    return tirx.Ramp(start, 1, n)


def interleaved_kernel(N: int, K: int, tokens: int):
    from ds4tvm.kernels.cpu_int8 import _bc, _vec

    G, KB = N // 16, K // 32

    @T.prim_func(s_tir=True)
    def f(w_h: T.handle, s_h: T.handle, c_h: T.handle, xu_h: T.handle, dx_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "global_symbol": "f"})
        W = T.match_buffer(w_h, (G, KB, 8, 64), "int8")
        S = T.match_buffer(s_h, (G, KB, 16), "float32")
        C = T.match_buffer(c_h, (G, KB, 16), "int32")
        XU = T.match_buffer(xu_h, (tokens, K // 4), "int32")   # 4 unsigned input codes per int32
        DX = T.match_buffer(dx_h, (tokens, KB), "float32")
        Y = T.match_buffer(y_h, (tokens, N), "float32")
        for g in T.parallel(G):
            acc = T.decl_buffer((tokens, 16), "float32")
            ia = T.decl_buffer((2, 16), "int32")   # two chains of dot products
            for t in range(tokens):
                T.buffer_store(acc, _bc(0, "float32", 16), [t, _ramp(16)])
            for kb in range(KB):
                for t in T.unroll(tokens):
                    T.buffer_store(ia, _bc(0, "int32", 16) - _vec(C, (g, kb), 0, 16), [0, _ramp(16)])
                    T.buffer_store(ia, _bc(0, "int32", 16), [1, _ramp(16)])
                    for j in T.unroll(8):
                        T.buffer_store(ia, T.call_llvm_pure_intrin(
                            "int32x16", "llvm.x86.avx512.vpdpbusd.512", _vec(ia, (j % 2,), 0, 16),
                            T.reinterpret("uint8x64", tirx.Broadcast(XU[t, kb * 8 + j], 16)),
                            _vec(W, (g, kb, j), 0, 64)), [j % 2, _ramp(16)])
                    T.buffer_store(acc, _vec(acc, (t,), 0, 16)
                                   + (_vec(ia, (0,), 0, 16) + _vec(ia, (1,), 0, 16)).astype("float32x16")
                                   * (_vec(S, (g, kb), 0, 16) * tirx.Broadcast(DX[t, kb], 16)), [t, _ramp(16)])
            for t in range(tokens):
                T.buffer_store(Y, _vec(acc, (t,), 0, 16), [t, _ramp(16, g * 16)])
    return f


def _seconds(call, reps: int = 100) -> float:
    call()
    t = time.perf_counter()
    for _ in range(reps):
        call()
    return (time.perf_counter() - t) / reps


def repack(qs: np.ndarray, d: np.ndarray):
    """(codes, scales, corrections) of Q8_0 codes [N, K] int8 and scales [N, K/32] float32."""
    N, K = qs.shape
    G, KB = N // 16, K // 32
    codes = qs.reshape(G, 16, KB, 8, 4).transpose(0, 2, 3, 1, 4).reshape(G, KB, 8, 64).copy()
    scales = d.reshape(G, 16, KB).transpose(0, 2, 1).copy()
    corr = (128 * qs.astype(np.int32).reshape(G, 16, KB, 32).sum(-1)).transpose(0, 2, 1).astype(np.int32).copy()
    return codes, scales, corr


def main() -> None:
    from cpu_kernels import build

    from ds4tvm.gguf.quant import to_planes

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=512)
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(a.threads)
    N, K = a.rows, a.cols
    rng = np.random.default_rng(0)
    values = rng.standard_normal((N, K)).astype(np.float32)
    from ds4tvm.gguf.quant import quantize

    raw = quantize(values, QT.Q8_0)
    planes = to_planes(raw, QT.Q8_0, (N, K))
    qs, d = planes.fields["qs"].reshape(N, K), planes.fields["d"].reshape(N, K // 32).astype(np.float32)
    packed = [tvm.runtime.tensor(p) for p in repack(qs, d)]
    target = tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})
    from ds4tvm.gguf.quant import random_blocks
    from ds4tvm.kernels.cpu import Blocking

    # the blocking a batched decode's or a verify's linears take (rows one at a time: forms.cpu_linear)
    vm, params = build(QT.Q8_0, 4, N, K, 1, a.threads, "int8", Blocking(rows=1, tokens=6))
    experts = to_planes(random_blocks(QT.Q8_0, (4, N, K), rng), QT.Q8_0, (4, N, K))
    weights = [tvm.runtime.tensor(np.ascontiguousarray((planes if name.startswith("w.") else experts).fields[
        name.split("plane_")[1]])) for name, _ in params]
    print(f"Q8_0 {N} x {K}, {a.threads} threads, weights in the cache; us per call (GMAC/s)")
    print("| tokens | kernels/cpu.py int8 | interleaved 16 rows | speed-up |")
    print("|---|---|---|---|")
    for n in (int(t) for t in a.tokens.split(",")):
        mod = tvm.compile(tvm.IRModule({"f": interleaved_kernel(N, K, n)}), target=target)
        f = mod["f"]
        xq = rng.integers(-127, 128, (n, K), dtype=np.int8)
        dx = (rng.random((n, K // 32)) * 0.02).astype(np.float32)
        xu = (xq.astype(np.int16) + 128).astype(np.uint8).view(np.int32).reshape(n, K // 4)
        args = [*packed, tvm.runtime.tensor(xu), tvm.runtime.tensor(dx), tvm.runtime.empty((n, N), "float32")]
        f(*args)
        want = np.einsum("tbk,nbk,tb,nb->tn", xq.reshape(n, -1, 32).astype(np.float64),
                         qs.reshape(N, -1, 32).astype(np.float64), dx, d)
        err = np.abs(args[-1].numpy() - want).max() / np.abs(want).max()
        assert err < 1e-5, err
        x = tvm.runtime.tensor(rng.standard_normal((n, K)).astype(np.float32))
        fn = "dense1" if n == 1 else "dense"
        ours, proto = (min(_seconds(call) for _ in range(5)) for call in
                       (lambda: vm[fn](x, *weights), lambda: f(*args)))
        macs = N * K * n
        print(f"| {n} | {1e6 * ours:.1f} ({macs / ours / 1e9:.0f}) | {1e6 * proto:.1f} ({macs / proto / 1e9:.0f}) "
              f"| {ours / proto:.2f}x |")


if __name__ == "__main__":
    main()
