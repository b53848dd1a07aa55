"""Every plane format's linears in their GPU forms (nn/qweight.py, kernels/gpu.py) on cuda:sm_90,
codegen only: dense, grouped and routed-expert linears at one token (decode) and at a symbolic
token count (verify, prefill), and the routed experts' up projection with the SwiGLU as its
epilogue, are scheduled by a GEMV-family or Matmul rule (the dense ones of a
symbolic width by LowBatchGEMV up to 8 tokens and Matmul above, in one kernel), never by Fallback,
and each builds to CUDA source (the GEMV ones reducing across a warp with shuffles)."""

import pytest
from gguf import GGMLQuantizationType as QT

pytestmark = pytest.mark.targets
FORMATS = [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_1, QT.Q4_K, QT.Q2_K, QT.Q6_K, QT.MXFP4, QT.IQ2_XXS]
E, N, J = 4, 64, 2


def _module(qtype, K):
    from tvm.relax.frontend import nn

    from ds4tvm.nn.qweight import QWeight

    class Linears(nn.Module):
        def __init__(self):
            self.dense = QWeight("dense.weight", qtype, (N, K))
            self.grouped = QWeight("grouped.weight", qtype, (2 * N, K))
            self.experts = QWeight("experts.weight", qtype, (E, N, K))

        def forward(self, x: nn.Tensor, xs: nn.Tensor, ids: nn.Tensor):
            n = x.shape[0]
            g = self.grouped.grouped_linear(nn.op.reshape(nn.op.concat([x, x], dim=1), (n, 2, K)), 2)
            shared = self.experts.expert_linear(x, ids)
            per_slot = self.experts.expert_linear(xs, ids)
            act = self.experts.expert_swiglu(shared, x, ids, 7.0)   # the SwiGLU as the up GEMV's epilogue
            return self.dense.linear(x), g, shared, per_slot, act

    return Linears()


# K = 512 for every format; 256 (one super-block per row) sends the K-quants' experts to the flat form
CASES = [pytest.param(q, 512, id=q.name) for q in FORMATS] + [
    pytest.param(q, 256, id=f"{q.name}-flat", marks=() if q == QT.Q4_K else pytest.mark.slow)
    for q in (QT.Q4_K, QT.Q2_K, QT.Q6_K)]


@pytest.mark.parametrize("qtype,K", CASES)
def test_linears_take_gemv_rules_not_fallback(qtype, K):
    import tvm
    from tvm.relax import transform
    from tvm.relax.frontend import nn

    from ds4tvm.kernels.forms import Forms
    from ds4tvm.nn.qweight import set_forms
    from ds4tvm.schedules.gpu import apply_rules, low_batch_specialize, rules

    tgt = tvm.target.Target({"kind": "cuda", "arch": "sm_90", "host": {"kind": "llvm"}})
    model = _module(qtype, K)
    mode = {"param_mode": "plain", "effect_mode": "none"}
    spec = {"decode": {"x": nn.spec.Tensor([1, K], "float32"), "xs": nn.spec.Tensor([1, J, K], "float32"),
                       "ids": nn.spec.Tensor([1, J], "int32"), "$": mode},
            "verify": {"x": nn.spec.Tensor(["k", K], "float32"), "xs": nn.spec.Tensor(["k", J, K], "float32"),
                       "ids": nn.spec.Tensor(["k", J], "int32"), "$": mode}}
    model.decode = model.verify = model.forward
    mod, _ = set_forms(model, Forms(gpu=True)).export_tvm(spec=spec)
    log = {}
    with tgt:
        mod = tvm.transform.Sequential([transform.LegalizeOps(), transform.AnnotateTIROpPattern(),
                                        low_batch_specialize(log), apply_rules(rules(), log)])(mod)
    linears = {name: rule for name, rule in log.items() if name.startswith("qlinear")}
    assert len(linears) >= 7, log   # dense, grouped, experts (shared or per-slot input) at 1 and k tokens, SwiGLU
    assert "Fallback" not in linears.values(), linears
    assert "LowBatchGEMV|Matmul" in linears.values(), linears   # the dense linear at verify widths
    for gv, func in mod.functions_items():   # CUDA source (codegen only: nvcc is not asked)
        if gv.name_hint in linears:
            with tgt:
                lib = tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=tgt)
            if "GEMV" in linears[gv.name_hint]:   # the reduction across a warp
                assert "__shfl" in lib.imports[0].inspect_source(), gv.name_hint
    print(qtype.name, K, sorted(set(linears.values())))
