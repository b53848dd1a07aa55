"""Functions whose arguments are recorded: what CUDA graphs need (gpu-guide.md section 2).

RewriteCUDAGraph captures only kernels whose arguments are static (the function's parameters after
its `num_input`, or storage planned at a constant size), and a kernel taking a symbolic shape
variable ends the captured region. A function with static shapes (decode: one token) is rewritten
so that nothing in it is per call:

- the position, exported as a shape `R.Shape([start])` and passed to kernels as a scalar, becomes
  a [1] int64 tensor that those kernels read (`start_buf[0]`); a batched decode's starts (a tuple
  of one such shape per sequence) one [B] tensor, read at each sequence's index;
- `num_input` becomes 0: every argument (token ids, position, states, weights) is static, so the
  caller must pass the same tensors on every call and write the call's values into them (a replay
  reads and writes the addresses recorded at capture). The artifact's FunctionSpec says so
  (`recorded`), and the engine keeps those tensors (runtime/engine.py);
- the state tuple (a batched decode's: a tuple of each sequence's) becomes one parameter per
  state tensor (`ds4.states`: where they are; the engine passes each row's: runtime/residency.py), and once
  the graph is captured the function returns those parameters as its updated states (they are
  written in place; the exporter returns the states in the order it takes them): reading each state
  out of a tuple on the way in, and each written one out of the graph's results on the way out,
  was one VM instruction per state tensor outside the graph;
- the tensors it returns are copied by one kernel at its end (added once kernels are scheduled:
  finish_recorded), so that the kernels computing them write planned storage inside the graph (a
  kernel writing a per-call output in the middle of the step splits the graph); after capture,
  the graph's cached storage reaches the captured function as one tuple, and kills that free
  nothing go (trim_outside_graphs).

A function called at several token counts (verify) is recorded at each width it is compiled for.
It is exported a second time as its width template (width_template), its token count named
nn/state.RECORDED_WIDTH so that the family's code makes no shape depend on the position (as in a
decode step), and `width_copies` replaces the template by a copy per width. A copy goes through
this rewrite and fusion with its token count still symbolic, calling the kernels the symbolic
functions call (its linears keep low_batch_specialize's branches on the token count, taken inside
the kernel), and is bound to its width only after the kernels are scheduled (finish_recorded):
every call in it is then static and RewriteCUDAGraph captures it. Bound before fusion, FuseTIR
fails (a kernel's symbolic buffer and the static tensor bound to it); exported at each width,
every kernel is compiled once more per width and dlight's Matmul takes its linears.

The input parameters are counted in `ds4.num_args` (schedules/report.py reads it to tell weights
from inputs). A function that cannot be rewritten (the position used other than as a kernel's
scalar argument) is left as it was and is not recorded.
"""

from __future__ import annotations

import tvm

from ..artifact import width_variant
from ..kernels.tags import OPAQUE
from .fusion import block_like
from .vmir import GRAPH_CALL, NUM_ARGS, calls_builtin

STATES = "ds4.states"   # [first parameter, count] of the state tensors of a recorded function
WIDTH = "ds4.width"     # the token count a copy of a function is bound to (width_copies)


def record_arguments(recorded: list):
    """A pass (after LegalizeOps) rewriting every exported function with static shapes (and every
    width copy) as above; appends their names to `recorded`."""
    from tvm import relax

    @tvm.transform.module_pass(opt_level=0, name="RecordArguments")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        bb = relax.BlockBuilder(mod)
        kernels: dict = {}   # kernels added here, by what they are (see _kernel_reading)
        rewritten = []
        for gv, func in list(mod.functions_items()):
            if isinstance(func, relax.Function) and func.attrs is not None and "num_input" in func.attrs:
                new = _rewrite(bb, func, kernels)
                if new is not None:
                    rewritten.append((gv, new))
        mod = bb.get()
        for gv, func in rewritten:
            mod[gv] = func
            recorded.append(gv.name_hint)
        return relax.transform.Normalize()(mod)

    return _pass


def _static(ty, width=None) -> bool:
    """Whether ty's shapes are constants (or the width variable of a width copy)."""
    from tvm import relax, tirx

    if isinstance(ty, relax.TupleType):
        return all(_static(f, width) for f in ty.fields)
    if isinstance(ty, relax.TensorType):
        return ty.shape is not None and all(isinstance(d, tirx.IntImm) or (width is not None and d.same_as(width))
                                            for d in ty.shape.values)
    return False


def _width_var(func):
    """The one symbolic dimension of func's tensor parameters (its token count), else None."""
    from tvm import relax, tirx

    found = []
    for p in func.params:
        if isinstance(p.ty, relax.TensorType) and p.ty.shape is not None:
            found += [d for d in p.ty.shape.values if isinstance(d, tirx.Var) and not any(d.same_as(f) for f in found)]
    return found[0] if len(found) == 1 else None


def width_template(fn: str) -> str:
    """The name fn is exported under a second time, its token count named nn/state.RECORDED_WIDTH:
    the function width_copies copies."""
    return f"{fn}_width"


def width_copies(widths: dict):
    """A pass (after LegalizeOps, before record_arguments) replacing, for each function name ->
    widths in `widths`, its width template by a copy per width (see above), named
    width_variant(fn, width)."""
    from tvm import relax

    @tvm.transform.module_pass(opt_level=0, name="WidthCopies")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        names = {gv.name_hint: gv for gv in mod.get_global_vars()}
        for fn, ws in widths.items():
            gv = names.get(width_template(fn))
            if gv is None:
                continue
            template = mod[gv]
            del mod[gv]
            if _width_var(template) is None:
                continue
            for w in ws:
                name = width_variant(fn, w)
                copy = relax.utils.copy_with_new_vars(template)   # FuseOps takes the module's bindings as one graph
                mod[tvm.ir.GlobalVar(name)] = copy.with_attr("global_symbol", name).with_attr(WIDTH, int(w))
        return mod

    return _pass


def _position_param(func):
    """(index, shape variables) of the position parameter, R.Shape([start]) or (a batched
    function) a tuple of one R.Shape([start]) per sequence; None if there is none, or False when the
    function has another non-static parameter."""
    from tvm import relax, tirx

    def starts(ty):
        if isinstance(ty, relax.ShapeType):
            values = ty.values
            return [values[0]] if values is not None and len(values) == 1 and isinstance(values[0], tirx.Var) else None
        if isinstance(ty, relax.TupleType) and ty.fields and all(isinstance(f, relax.ShapeType) for f in ty.fields):
            each = [starts(f) for f in ty.fields]
            return None if None in each else [v for one in each for v in one]
        return None

    found = None
    width = _width_var(func) if WIDTH in (func.attrs or {}) else None
    for i, p in enumerate(func.params):
        if isinstance(p.ty, relax.ShapeType) or (isinstance(p.ty, relax.TupleType) and p.ty.fields
                                                 and isinstance(p.ty.fields[0], relax.ShapeType)):
            variables = starts(p.ty)
            if found is not None or variables is None:
                return False
            found = (i, variables)
        elif not _static(p.ty, width):
            return False
    return found


def _rewrite(bb, func, kernels):
    from tvm import relax

    position = _position_param(func)
    if position is False or not isinstance(func.body, relax.SeqExpr):
        return None
    params = list(func.params)
    if position is not None:
        index, starts = position
        pos = relax.Var("position", relax.TensorType((len(starts),), "int64"))
        params[index] = pos
        body = _with_position_tensor(bb, func.body, starts, pos, kernels, func.params[index])
        if body is None:
            return None
    else:
        body = func.body
    flat = _flattened_states(params, body)
    if flat is None:
        return None
    params, body, states = flat
    new = relax.Function(params, body, func.ret_ty, func.is_pure, func.attrs, func.span)
    if position is not None and (any(v.same_as(s) for v in relax.analysis.free_symbolic_vars(new) for s in starts)
                                 or any(v.same_as(func.params[index]) for v in relax.analysis.free_vars(new))):
        return None
    inputs = int(func.attrs["num_input"]) + (states[1] - 1 if states is not None else 0)   # the tuple, flattened
    new = new.with_attr(NUM_ARGS, inputs).with_attr("num_input", 0)
    return new.with_attr(STATES, states) if states is not None else new


def _flattened_states(params, body):
    """(params, body, [first, count]) with the tuple parameter (the states; a batched function's: a
    tuple of each sequence's) as one parameter per tensor, its TupleGetItem bindings those
    parameters; [first, count] None without one. None if there are several or it is used otherwise."""
    from tvm import relax

    tuples = [i for i, p in enumerate(params) if isinstance(p.ty, relax.TupleType)]
    if not tuples:
        return params, body, None
    if len(tuples) > 1:
        return None
    i = tuples[0]
    p = params[i]
    fields = []

    def leaves(ty, name):   # the tuple's structure with a parameter for each tensor
        if isinstance(ty, relax.TupleType):
            return [leaves(f, f"{name}_{j}") for j, f in enumerate(ty.fields)]
        fields.append(relax.Var(name, ty))
        return fields[-1]

    tuple_of = {p: leaves(p.ty, p.name)}   # the tuple variables bound so far -> their structure
    blocks = []
    for block in body.blocks:
        bindings = []
        for b in block.bindings:
            v = b.value
            held = next((t for var, t in tuple_of.items() if isinstance(v, relax.TupleGetItem)
                         and v.tuple_value.same_as(var)), None)
            if held is not None:
                if isinstance(held[v.index], list):
                    tuple_of[b.var] = held[v.index]
                    continue
                b = relax.VarBinding(b.var, held[v.index])
            elif any(_mentions(v, var) for var in tuple_of):
                return None
            bindings.append(b)
        blocks.append(block_like(block, bindings))
    if any(_mentions(body.body, var) for var in tuple_of):
        return None
    return params[:i] + fields + params[i + 1:], relax.SeqExpr(blocks, body.body), [i, len(fields)]


def finish_recorded():
    """A pass (after the kernels are scheduled) on the functions record_arguments rewrote: a width
    copy bound to its width, then the tensors each returns copied at its end."""
    from tvm import relax

    @tvm.transform.module_pass(opt_level=0, name="FinishRecorded")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        bb = relax.BlockBuilder(mod)
        kernels: dict = {}
        finished = []
        for gv, func in list(mod.functions_items()):
            if isinstance(func, relax.Function) and NUM_ARGS in (func.attrs or {}):
                if WIDTH in func.attrs:
                    func = func.bind_symbolic_vars({_width_var(func): int(func.attrs[WIDTH])})
                body = _outputs_copied_last(bb, func.body, kernels)
                finished.append((gv, relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs,
                                                    func.span)))
        mod = bb.get()
        for gv, func in finished:
            mod[gv] = func
        return relax.transform.Normalize()(mod)

    return _pass


def _outputs_copied_last(bb, body, kernels):
    """body with the tensors it returns (not the states) copied by one kernel just before it
    returns: the kernels that compute the outputs then write planned storage, inside the graph, and
    only the copy, at the end, writes the tensors allocated at each call (a kernel writing one of
    those in the middle of the step splits the graph in two)."""
    from tvm import relax

    out = body.body
    blocks = []
    for block in body.blocks:
        bindings = []
        for b in block.bindings:
            if b.var.same_as(out) and isinstance(b.value, relax.Tuple):
                tensors = [f for f in b.value.fields if isinstance(f, relax.Var) and isinstance(f.ty, relax.TensorType)]
                if tensors:
                    types = [t.ty for t in tensors]
                    one = len(types) == 1   # call_tir of one output returns the tensor, not a tuple
                    copies = relax.Var("outputs", types[0] if one else relax.TupleType(types))
                    bindings.append(relax.VarBinding(copies, relax.call_tir(
                        _copy_kernel(bb, types, kernels), tensors, types[0] if one else types)))
                    fields, n = [], 0
                    for f in b.value.fields:
                        if any(f.same_as(t) for t in tensors):
                            copy = copies if one else relax.Var(f"{f.name}_out", f.ty)
                            if not one:
                                bindings.append(relax.VarBinding(copy, relax.TupleGetItem(copies, n)))
                            f, n = copy, n + 1
                        fields.append(f)
                    b = relax.VarBinding(b.var, relax.Tuple(fields))
            bindings.append(b)
        blocks.append(block_like(block, bindings))
    return relax.SeqExpr(blocks, out)


def _copy_kernel(bb, types, kernels):
    """An opaque (never fused) kernel copying tensors of the given types."""
    key = ("copy", tuple(str(t) for t in types))
    if key not in kernels:
        name = f"output_copy{len(kernels)}"
        func = _copies([[int(d) for d in t.shape.values] for t in types], [t.dtype for t in types], name)
        kernels[key] = bb.add_func(func, name)
    return kernels[key]


def _copies(shapes: list, dtypes: list, name: str, threads: int = 256):
    """A PrimFunc copying each of its first len(shapes) buffers into the next ones, written
    scheduled: one launch over the largest of them, a thread per element, each copy under the
    condition of its size (dlight's Fallback made one launch per tensor); on a CPU target the
    same loops serial."""
    import math

    from tvm import tirx
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as B

    from ..kernels.gpu import hand_kernel

    target = tvm.target.Target.current(allow_none=True)
    bind = target is not None and target.kind.name != "llvm"
    sizes = [math.prod(s) for s in shapes]
    with IRBuilder() as ib:
        with B.prim_func():
            B.func_name(name)
            B.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": OPAQUE,
                         "global_symbol": name})
            ins = [B.arg(f"a{i}", B.buffer(s, d)) for i, (s, d) in enumerate(zip(shapes, dtypes))]
            outs = [B.arg(f"copy{i}", B.buffer(s, d)) for i, (s, d) in enumerate(zip(shapes, dtypes))]
            with (B.thread_binding((max(sizes) + threads - 1) // threads, thread="blockIdx.x") if bind
                  else B.serial((max(sizes) + threads - 1) // threads)) as bx:
                with B.thread_binding(threads, thread="threadIdx.x") if bind else B.serial(threads) as tx:
                    i = bx * threads + tx
                    for a, c, shape, size in zip(ins, outs, shapes, sizes):
                        at, rest = [], i
                        for d in reversed(shape):
                            at.insert(0, rest % d)
                            rest = rest // d
                        with B.If(i < size):
                            with B.Then():
                                B.buffer_store(c, tirx.BufferLoad(a, at), at)
    return hand_kernel(ib.get())


def _mentions(value, var) -> bool:
    from tvm import relax

    if isinstance(value, relax.Call):
        return any(_mentions(a, var) for a in value.args)
    if isinstance(value, relax.Tuple):
        return any(_mentions(f, var) for f in value.fields)
    if isinstance(value, relax.TupleGetItem):
        return _mentions(value.tuple_value, var)
    return value.same_as(var)


def _with_position_tensor(bb, body, starts, pos, kernels, param):
    """The body with every kernel argument that is an expression of the `starts` (a sequence's
    first position each) replaced by the tensor pos holding them (the kernel rewritten to read
    it), or None where they are used otherwise. Reads of a sequence's shape out of the parameter
    (param, a tuple of shapes) go: the caller checks nothing else reads them."""
    from tvm import relax

    ops = (tvm.ir.Op.get("relax.call_tir"), tvm.ir.Op.get("relax.call_tir_inplace"))
    blocks = []
    for block in body.blocks:
        bindings = []
        for b in block.bindings:
            v = b.value
            if isinstance(v, relax.TupleGetItem) and v.tuple_value.same_as(param):
                continue
            if isinstance(v, relax.Call) and v.op in ops:
                args = list(v.args[1].fields)
                uses = [i for i, a in enumerate(args) if isinstance(a.ty, tvm.ir.PrimType) and _uses(a, starts)]
                if uses:
                    if len(v.args) > 2 and v.op == ops[0]:
                        return None   # shape arguments (tir_vars): not written by any family
                    gv = v.args[0]
                    for i in uses:
                        gv = _kernel_reading(bb, gv, i, args[i], starts, kernels)
                        if gv is None:
                            return None
                        args[i] = pos
                    v = relax.Call(v.op, [gv, relax.Tuple(args), *v.args[2:]], v.attrs, v.ty_args)
                    b = relax.VarBinding(b.var, v)
            bindings.append(b)
        blocks.append(block_like(block, bindings))
    return relax.SeqExpr(blocks, body.body)


def _uses(expr, variables) -> bool:
    from tvm import tirx

    return any(v.same_as(var) for v in tirx.analysis.undefined_vars(expr) for var in variables)


def _replaced(expr, values: list):
    """expr (integer arithmetic on variables and constants) with each variable replaced by its
    value, values holding (variable, value) pairs; None for any other expression."""
    from tvm import tirx

    for var, value in values:
        if expr.same_as(var):
            return value
    if isinstance(expr, tirx.IntImm):
        return expr
    if isinstance(expr, (tirx.Add, tirx.Sub, tirx.Mul, tirx.FloorDiv, tirx.FloorMod, tirx.Min, tirx.Max)):
        a, b = _replaced(expr.a, values), _replaced(expr.b, values)
        return None if a is None or b is None else type(expr)(a, b)
    return None


def _kernel_reading(bb, gv, index: int, expr, starts, kernels):
    """Kernel gv with its scalar parameter `index` (given `expr` of the starts) replaced by a
    [len(starts)] int64 buffer holding them: the kernel computes expr from it."""
    from tvm import tirx

    key = (gv.name_hint, index, str(expr), len(starts))
    if key not in kernels:
        func = bb.get()[gv]
        buf = tirx.decl_buffer((len(starts),), "int64", "position")
        value = _replaced(expr, [(s, tirx.BufferLoad(buf, [tirx.IntImm("int64", j)])) for j, s in enumerate(starts)])
        if value is None:
            return None
        spec = func.specialize({func.params[index]: value})
        params = list(spec.params)
        params.insert(index, buf)
        name = f"{gv.name_hint}_pos{len(kernels)}"
        kernels[key] = bb.add_func(tirx.PrimFunc(params, spec.body, spec.ret_type, spec.attrs)
                                   .with_attr("global_symbol", name), name)
    return kernels[key]


def trim_outside_graphs():
    """A pass (last, on the VM-level functions) for functions that replay a CUDA graph: the graph's
    cached storage goes to the captured function as its one tuple, the returned states become the
    state parameters (see above), the graph results then unread are not read out, and kills that
    free nothing go (of values read out of a tuple, which keeps them alive; in a recorded function,
    every kill: the little it allocates outside the graph is freed when the call returns)."""
    from tvm import relax

    @tvm.transform.module_pass(opt_level=0, name="TrimOutsideGraphs")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for gv, func in list(mod.functions_items()):
            if isinstance(func, relax.Function) and isinstance(func.body, relax.SeqExpr) and _replays_graph(func):
                mod[gv] = _trimmed(_storage_as_tuple(mod, func))
        return mod

    return _pass


CACHED_ALLOC = "vm.builtin.cuda_graph.get_cached_alloc"


def _storage_as_tuple(mod, func):
    """func with its graph call passing the graph's cached storage as the one tuple it is cached in
    (the captured function reads the storages out of it), instead of reading each storage out of
    that tuple outside the graph at every call: the captured function runs only at capture."""
    from tvm import relax

    bindings = [b for block in func.body.blocks for b in block.bindings]
    cached = next((b.var for b in bindings if calls_builtin(b.value, CACHED_ALLOC)), None)
    call = next((b for b in bindings if calls_builtin(b.value, GRAPH_CALL)), None)
    if cached is None or call is None:
        return func
    index = {b.var: int(b.value.index) for b in bindings
             if isinstance(b.value, relax.TupleGetItem) and b.value.tuple_value.same_as(cached)}
    capture_gv, args, *rest = call.value.args[1].fields
    capture = mod[capture_gv]
    whole = relax.Var("cached", cached.ty)
    keep, reads = [], []
    for arg, param in zip(args.fields, capture.params):
        i = next((i for v, i in index.items() if v.same_as(arg)), None)
        if i is None:
            keep.append((arg, param))
        else:
            reads.append(relax.VarBinding(param, relax.TupleGetItem(whole, i)))
    if not reads:
        return func
    mod[capture_gv] = relax.Function([p for _, p in keep] + [whole],
                                     relax.SeqExpr([relax.BindingBlock(reads), *capture.body.blocks], capture.body.body),
                                     capture.ret_ty, capture.is_pure, capture.attrs, capture.span)
    value = relax.Call(call.value.op, [call.value.args[0], relax.Tuple([capture_gv, relax.Tuple([a for a, _ in keep] + [cached]),
                                                                       *rest])], call.value.attrs, call.value.ty_args)
    kill = tvm.ir.Op.get("relax.vm.kill_object")
    bindings = [relax.VarBinding(b.var, value) if b is call else b for b in bindings
                if not (isinstance(b.value, relax.Call) and b.value.op == kill and b.value.args[0].same_as(cached))]
    return relax.Function(func.params, relax.SeqExpr([relax.BindingBlock(bindings)], func.body.body), func.ret_ty,
                          func.is_pure, func.attrs, func.span)


def _replays_graph(func) -> bool:
    return any(calls_builtin(b.value, GRAPH_CALL) for block in func.body.blocks for b in block.bindings)


def _trimmed(func):
    from tvm import relax

    kill = tvm.ir.Op.get("relax.vm.kill_object")
    bindings = [b for block in func.body.blocks for b in block.bindings]
    attrs = func.attrs or {}
    if STATES in attrs:
        first, count = (int(x) for x in attrs[STATES])
        states = list(func.params[first:first + count])
        bindings = [relax.VarBinding(b.var, _states_returned(b.value, states)) if b.var.same_as(func.body.body)
                    else b for b in bindings]
    borrowed = [b.var for b in bindings if isinstance(b.value, relax.TupleGetItem)]
    recorded = NUM_ARGS in attrs

    def frees_nothing(b) -> bool:
        """A kill of a value read out of a tuple, or any kill in a recorded function: what runs
        outside its graph are the few allocations of its outputs, freed when the call returns."""
        return isinstance(b.value, relax.Call) and b.value.op == kill and \
            (recorded or any(v.same_as(b.value.args[0]) for v in borrowed))

    bindings = [b for b in bindings if not frees_nothing(b)]
    while True:   # tuple reads nothing reads any more
        used = [v for b in bindings for v in relax.analysis.free_vars(b.value)] + [func.body.body]
        unread = [b for b in bindings if isinstance(b.value, relax.TupleGetItem) and not any(u.same_as(b.var) for u in used)]
        if not unread:
            break
        bindings = [b for b in bindings if not any(b is u for u in unread)]
    return relax.Function(func.params, relax.SeqExpr([relax.BindingBlock(bindings)], func.body.body), func.ret_ty,
                          func.is_pure, func.attrs, func.span)


def _states_returned(value, states):
    """The returned tuple with its updated states (its last field, or a batched function's last
    fields, one per sequence: tuples of as many tensors of the same types as the state parameters)
    replaced by the state parameters, which hold them."""
    from tvm import relax

    if not isinstance(value, relax.Tuple) or not value.fields:
        return value
    fields, per_sequence = list(value.fields), []
    while sum(len(t.fields) for t in per_sequence) < len(states) and fields and isinstance(fields[-1], relax.Tuple):
        per_sequence.insert(0, fields.pop())
    returned = [f for t in per_sequence for f in t.fields]
    if len(returned) != len(states) or any(str(f.ty) != str(s.ty) for f, s in zip(returned, states)):
        return value
    held, at = [], 0
    for t in per_sequence:
        held.append(relax.Tuple(states[at:at + len(t.fields)]))
        at += len(t.fields)
    return relax.Tuple([*fields, *held])
