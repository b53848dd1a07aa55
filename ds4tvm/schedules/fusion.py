"""Operator fusion that respects state written in place (gpu-guide.md section 3).

FuseOps emits a fused group at its last binding, so a kernel reading the old rows of a KV ring,
fused into a consumer that comes after the ring's in-place write, would read the new rows. Before
fusing, every in-place state writer (`call_tir_inplace`: nn/state.py's ring_write, emit_rows,
recurrent_write) becomes opaque (never fused) and takes the outputs of the earlier kernels that
read the state it writes as extra, unused arguments: those readers (and whatever they are fused
into) must then run before the write. Kernels written already scheduled (hand kernels) stay
opaque too, since fusing would drop their schedule.
"""

from __future__ import annotations

import tvm

from ..kernels.tags import OPAQUE, PRESET

def fusion_passes() -> list:
    from tvm.relax import transform

    return [transform.AnnotateTIROpPattern(), preset_patterns(), protect_state_writes(), transform.FuseOps(),
            transform.FuseTIR()]


def preset_patterns():
    """The PRESET op pattern for the calls of one token (a decode step's). hc_post: each output
    element reads one element of the sublayer's output (and the residual streams), so FuseOps may
    take it as the epilogue of the GEMV that computes that output, which dlight's GEMV schedules;
    its Matmul rule cannot (a consumer with one more axis), so wider calls keep the analysis'
    kInjective. The embedding's gather: injective, where the analysis says opaque."""
    from tvm import relax, tirx

    call_tir = tvm.ir.Op.get("relax.call_tir")

    @tvm.transform.module_pass(opt_level=0, name="PresetPatterns")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        bb = relax.BlockBuilder(mod)
        copies: dict = {}   # PrimFunc's GlobalVar -> its copy with the preset pattern

        def preset(gv):
            if gv not in copies:
                func = bb.get()[gv]
                copy = func.with_attr("op_pattern", int(func.attrs[PRESET])).without_attr(PRESET)
                copies[gv] = bb.add_func(copy, f"{gv.name_hint}_one_token")
            return copies[gv]

        def rebind(b):
            v = b.value
            if not (isinstance(v, relax.Call) and v.op == call_tir):
                return b
            func = bb.get()[v.args[0]]
            shape = getattr(b.var.ty, "shape", None)
            if (isinstance(func, tirx.PrimFunc) and func.attrs is not None and PRESET in func.attrs
                    and shape is not None and isinstance(shape.values[0], tirx.IntImm) and shape.values[0].value == 1):
                return relax.VarBinding(b.var, relax.Call(call_tir, [preset(v.args[0]), *v.args[1:]], v.attrs,
                                                          v.ty_args))
            return b

        rewritten = [(gv, rebound(func, rebind)) for gv, func in list(mod.functions_items())
                     if isinstance(func, relax.Function)]
        mod = bb.get()
        for gv, func in rewritten:
            mod[gv] = func
        return mod

    return _pass


def rebound(func, rebind):
    """func with every binding b of its body replaced by rebind(b)."""
    from tvm import relax

    if not isinstance(func.body, relax.SeqExpr):
        return func
    blocks = [block_like(block, [rebind(b) for b in block.bindings]) for block in func.body.blocks]
    return relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty, func.is_pure,
                          func.attrs, func.span)


def protect_state_writes():
    from tvm import relax, tirx

    call_tir, inplace = tvm.ir.Op.get("relax.call_tir"), tvm.ir.Op.get("relax.call_tir_inplace")

    @tvm.transform.module_pass(opt_level=0, name="ProtectStateWrites")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for gv, func in list(mod.functions_items()):
            if isinstance(func, tirx.PrimFunc) and func.attrs is not None and func.attrs.get("tirx.is_scheduled"):
                mod[gv] = func.with_attr("op_pattern", OPAQUE)
        bb = relax.BlockBuilder(mod)
        writers: dict = {}   # (writer, its extra arguments' types) -> the writer with those parameters
        rewritten = [(gv, _with_read_dependencies(bb, func, call_tir, inplace, writers))
                     for gv, func in list(mod.functions_items()) if isinstance(func, relax.Function)]
        mod = bb.get()
        for gv, func in rewritten:
            mod[gv] = func
        return relax.transform.Normalize()(mod)

    return _pass


def _with_read_dependencies(bb, func, call_tir, inplace, writers):
    from tvm import relax

    if not isinstance(func.body, relax.SeqExpr):
        return func
    blocks = []
    for block in func.body.blocks:
        readers: dict = {}   # state var -> vars of the earlier calls that read it
        bindings = []
        for b in block.bindings:
            v = b.value
            if isinstance(v, relax.Call) and v.op == inplace:
                args = list(v.args[1].fields)
                written = [args[int(i)] for i in v.attrs.inplace_indices]
                deps = [r for w in written for r in readers.get(w, []) if _is_tensor(r)]
                if deps:
                    gv = _writer_with(bb, v.args[0], len(args), [r.ty for r in deps], writers)
                    v = relax.Call(inplace, [gv, relax.Tuple(args + deps), *v.args[2:]], v.attrs, v.ty_args)
                    b = relax.VarBinding(b.var, v)
            elif isinstance(v, relax.Call) and v.op == call_tir:
                for a in v.args[1].fields:
                    if isinstance(a, relax.Var):
                        readers.setdefault(a, []).append(b.var)
            bindings.append(b)
        blocks.append(block_like(block, bindings))
    return relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty,
                          func.is_pure, func.attrs, func.span)


def block_like(block, bindings):
    """A binding block of the same kind as block (dataflow or not) holding bindings."""
    from tvm import relax

    return relax.DataflowBlock(bindings) if isinstance(block, relax.DataflowBlock) else relax.BindingBlock(bindings)


def _is_tensor(var) -> bool:
    from tvm import relax

    return isinstance(var.ty, relax.TensorType)


def _writer_with(bb, gv, n_args: int, extra, writers):
    """The writer PrimFunc gv with unused buffer parameters of the extra tensors' types after its
    n_args arguments (before the outputs it does not write in place), marked opaque (one copy per
    distinct list of types)."""
    from tvm import tirx

    key = (gv.name_hint, tuple(str(s) for s in extra))
    if key not in writers:
        func = bb.get()[gv]
        params, outputs = list(func.params[:n_args]), list(func.params[n_args:])
        for i, sinfo in enumerate(extra):
            shape = [d if isinstance(d, tirx.IntImm) else tirx.Var(f"after{i}_d{j}", "int64")
                     for j, d in enumerate(sinfo.shape.values)]
            params.append(tirx.decl_buffer(shape, sinfo.dtype, f"after{i}"))
        new = tirx.PrimFunc(params + outputs, func.body, func.ret_type, func.attrs).with_attr("op_pattern", OPAQUE)
        name = f"{gv.name_hint}_after{len(writers)}"
        writers[key] = bb.add_func(new.with_attr("global_symbol", name), name)
    return writers[key]
