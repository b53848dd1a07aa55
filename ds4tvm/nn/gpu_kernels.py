"""GPU forms of the routed-expert linears (../shared/reference/gpu-guide.md §1): the "blockized"
GEMV that dlight's GEMV rule schedules, as MLC-LLM writes its MoE GEMVs. One (token, slot) pair per
`blockIdx.y`; inside it an outer block reads the pair's expert id once, a `dequantize` block turns
that expert's rows into float32 (inlined by the rule into the product: no fp32 weight is written)
and a `gemv` block reduces over K. The expert's planes are read straight from the weight arguments
with nn/dequant.py's expressions, the same float operations as every other path."""

from __future__ import annotations

import functools

from gguf import GGMLQuantizationType as QT
from tvm.script import tirx as T

from .cpu_kernels import _arg_types, _dequant

# Formats whose dequantization gathers lookup tables by the weight's codes: dlight's GEMV rejects
# them in any form, so their experts keep the flat form (nn/qweight.py) that schedules/gpu.py's
# HandGEMV takes.
TABLE_GATHERED = (QT.IQ2_XXS,)
K_QUANTS = (QT.Q2_K, QT.Q4_K, QT.Q6_K)


def takes_blockized(qtype: QT, K: int) -> bool:
    """Whether the routed experts take expert_gemv. Not the table formats, and not a K-quant row of
    one 256-weight super-block: GEMV's schedule of that form fails in TVM 0.27's CUDA codegen (its
    two-block rows, K = 512 and up, compile); those take the flat form."""
    return qtype not in TABLE_GATHERED and not (qtype in K_QUANTS and K < 512)


@functools.lru_cache(maxsize=None)
def expert_gemv(qtype: QT, E: int, N: int, K: int, J: int, per_slot_input: bool, bind: bool = True):
    """y[T, J, N] = x[T, (J|1), K] @ W[ids[t, j], N, K]^T for any T (a decode's T = 1 is the case
    it is shaped for; wider calls run one GEMV per (token, slot) pair). bind=False: the pair loop
    serial, for checking the form's numerics on a CPU."""
    a = _arg_types(qtype, (E, N), K, False)
    deq = _dequant(qtype)
    XJ = J if per_slot_input else 1

    def x_of(x, s, k):
        return x[s // J, s % J if per_slot_input else 0, k]

    @T.prim_func(private=True, s_tir=True)
    def main(x_h: T.handle, ids_h: T.handle, w0: T.Buffer(*a[0]), w1: T.Buffer(*a[1]), w2: T.Buffer(*a[2]),
             w3: T.Buffer(*a[3]), w4: T.Buffer(*a[4]), w5: T.Buffer(*a[5]), w6: T.Buffer(*a[6]), y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n_tok = T.int64()
        x = T.match_buffer(x_h, (n_tok, XJ, K), "float32")
        ids = T.match_buffer(ids_h, (n_tok, J), "int32")
        y = T.match_buffer(y_h, (n_tok, J, N), "float32")
        for pair in (T.thread_binding(n_tok * J, thread="blockIdx.y") if bind else T.serial(n_tok * J)):
            with T.sblock("gemv_o"):
                s = T.axis.spatial(n_tok * J, pair)
                w = T.sblock_alloc_buffer((N, K), "float32")
                for i1, i2 in T.grid(N, K):
                    with T.sblock("dequantize"):
                        i, k = T.axis.remap("SS", [i1, i2])
                        w[i, k] = deq((ids[s // J, s % J], i), k, (w0, w1, w2, w3, w4, w5, w6))
                for i1, i2 in T.grid(N, K):
                    with T.sblock("gemv"):
                        i, k = T.axis.remap("SR", [i1, i2])
                        with T.init():
                            y[s // J, s % J, i] = T.float32(0)
                        y[s // J, s % J, i] = y[s // J, s % J, i] + x_of(x, s, k) * w[i, k]

    return main
