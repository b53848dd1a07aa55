"""`ds4-compile --report FILE.json`: for every compiled function, the kernels one call runs and what
scheduled each, read from the module as the VM will run it (after the pipeline, before code
generation), for any target:

  functions.<fn>.kernels          the kernels a call launches: {"kernel", "rule", "in_graph"}, those
                                  inside captured regions first, then the others in call order
                                  (both branches of a symbolic-shape specialisation are listed)
  functions.<fn>.n_kernels        their count
  functions.<fn>.n_launches       device kernels those calls launch: a kernel's `launches` is the
                                  number of its thread-bound loop nests, each a kernel of its own
                                  after code generation (dlight's Fallback gives one per reduction
                                  stage it cannot merge); 1 on the CPU
  functions.<fn>.by_rule          kernels per rule: a dlight rule's name (Matmul, GEMV, LowBatchGEMV,
                                  Reduction, GeneralReduction, Fallback), `hand` (written scheduled:
                                  kernels/cpu.py, the GPU delta rule), `tuned` (a meta-schedule
                                  record), `llvm:<kind>` (schedules/llvm.py's own), `host` (shape
                                  functions on the host), `as written`
  functions.<fn>.graph_regions    CUDA graph regions the call replays (0 where there are none)
  functions.<fn>.kernels_in_graphs
  functions.<fn>.outside_graphs   VM instructions the call runs outside those regions (kernel
                                  launches, allocations, kills, reshapes, shape checks)
  functions.<fn>.outside_by_kind  those by kind: kernel, graph (a region's replay), alloc, kill,
                                  tuple (building or reading a tuple), builtin (shape checks, ...)
  functions.<fn>.weights_only     kernels whose inputs are weights only (work that could be done
                                  once at load instead of every call)

The pipelines write what scheduled each kernel into a `RuleLog` (kernel name -> rule) as they run.
"""

from __future__ import annotations

from collections import Counter

from .vmir import GRAPH_CALL, builtin_of, calls_builtin, num_args

RuleLog = dict   # kernel (PrimFunc global name) -> the rule that scheduled it; WEIGHTS_ONLY -> {fn: [kernel]}
WEIGHTS_ONLY = "weights_only"
HAND = "hand"          # PrimFunc attribute value of ds4.schedule for kernels written scheduled


def rule_of(func, log: RuleLog, name: str) -> str:
    if name in log:
        return log[name]
    if name.startswith("shape_func"):   # VMShapeLower's host-side shape computation
        return "host"
    attrs = func.attrs or {}
    if attrs.get("ds4.schedule") == HAND or attrs.get("tirx.is_scheduled"):
        return HAND
    return "as written"


def _values(expr):
    """The values bound in a function body, with both branches of an If."""
    from tvm import relax

    out = []
    if isinstance(expr, relax.SeqExpr):
        for block in expr.blocks:
            for binding in block.bindings:
                v = binding.value
                out.append(v)
                if isinstance(v, relax.If):
                    out += _values(v.true_branch) + _values(v.false_branch)
    return out


def _kernels(mod, func, log: RuleLog, in_graph: bool) -> list[dict]:
    import tvm
    from tvm import relax

    out = []
    for v in _values(func.body):
        if isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.GlobalVar) and \
                isinstance(mod[v.op], tvm.tirx.PrimFunc):
            name = v.op.name_hint
            out.append({"kernel": name, "rule": rule_of(mod[v.op], log, name), "in_graph": in_graph,
                        "launches": device_launches(mod[v.op])})
    return out


def device_launches(func) -> int:
    """The device kernels a scheduled PrimFunc becomes: its outermost thread-bound loops or
    thread extents (at least 1: a CPU kernel, a host function)."""
    from tvm import s_tir, tirx

    def count(node) -> int:
        if isinstance(node, tirx.For):
            return 1 if node.kind == tirx.ForKind.THREAD_BINDING else count(node.body)
        if isinstance(node, tirx.AttrStmt) and node.attr_key == "thread_extent":   # TOPI's ir_builder kernels
            return 1
        if isinstance(node, tirx.SeqStmt):
            return sum(count(s) for s in node.seq)
        if isinstance(node, s_tir.SBlockRealize):
            return count(node.block)
        if isinstance(node, tirx.IfThenElse):   # one branch runs
            return max(count(node.then_case), count(node.else_case) if node.else_case is not None else 0)
        body = getattr(node, "body", None)
        return count(body) if isinstance(body, tirx.Stmt) else 0

    return max(1, count(func.body))


def function_report(mod, name: str, log: RuleLog) -> dict:
    from tvm import relax

    func = mod[name]
    kernels, regions, outside = [], 0, Counter()
    for v in _values(func.body):
        if not isinstance(v, (relax.Call, relax.Tuple, relax.TupleGetItem)):
            continue
        outside[_kind(mod, v)] += 1
        captured = _captured(v)
        if captured is not None:
            regions += 1
            kernels += _kernels(mod, mod[captured], log, True)
    kernels += _kernels(mod, func, log, False)
    return {"kernels": kernels, "n_kernels": len(kernels), "n_launches": sum(k["launches"] for k in kernels),
            "by_rule": dict(Counter(k["rule"] for k in kernels)),
            "graph_regions": regions, "kernels_in_graphs": sum(k["in_graph"] for k in kernels),
            "outside_graphs": sum(outside.values()), "outside_by_kind": dict(outside),
            "weights_only": log.get(WEIGHTS_ONLY, {}).get(name, [])}


def _captured(v):
    """The captured function a CUDA graph call replays (vm.builtin.cuda_graph.run_or_capture)."""
    import tvm
    from tvm import relax

    if calls_builtin(v, GRAPH_CALL):
        first = v.args[1].fields[0] if isinstance(v.args[0], relax.ExternFunc) else v.args[0]
        return first if isinstance(first, tvm.ir.GlobalVar) else None
    return None


def _kind(mod, v) -> str:
    """What a VM instruction outside the graphs is: kernel, graph, alloc, kill, tuple, builtin."""
    import tvm
    from tvm import relax

    if isinstance(v, (relax.Tuple, relax.TupleGetItem)):
        return "tuple"
    if isinstance(v.op, tvm.ir.GlobalVar):
        return "kernel" if isinstance(mod[v.op], tvm.tirx.PrimFunc) else "call"
    builtin = builtin_of(v) or getattr(v.op, "name", "")
    if builtin == GRAPH_CALL:
        return "graph"
    if "alloc" in builtin:
        return "alloc"
    if "kill" in builtin or "null_value" in builtin:
        return "kill"
    return "builtin"


def note_weights_only(log: RuleLog):
    """A pass (on call_tir form, before CallTIRRewrite) noting in log, per function, the kernels
    whose every input comes from the weights (the parameters after the function's num_input)."""
    import tvm
    from tvm import relax


    @tvm.transform.module_pass(opt_level=0, name="NoteWeightsOnly")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        found = log.setdefault(WEIGHTS_ONLY, {})
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function) or func.attrs is None or "num_input" not in func.attrs:
                continue
            derived = set(func.params[num_args(func):])
            found[gv.name_hint] = []
            for v in _bindings(func.body):
                if _from(v.value, derived):
                    derived.add(v.var)
                    if isinstance(v.value, relax.Call) and v.value.op == tvm.ir.Op.get("relax.call_tir"):
                        found[gv.name_hint].append(v.value.args[0].name_hint)
        return mod

    return _pass


def _bindings(expr):
    from tvm import relax

    if isinstance(expr, relax.SeqExpr):
        for block in expr.blocks:
            yield from block.bindings


def _from(value, derived: set) -> bool:
    """Whether a bound value is computed from the derived vars (and constants) alone."""
    import tvm
    from tvm import relax

    if isinstance(value, relax.Var):
        return value in derived
    if isinstance(value, relax.Tuple):
        return all(_from(f, derived) for f in value.fields)
    if isinstance(value, relax.TupleGetItem):
        return _from(value.tuple_value, derived)
    if isinstance(value, relax.Call):
        args = list(value.args[1:]) if value.op == tvm.ir.Op.get("relax.call_tir") else list(value.args)
        return bool(args) and all(_from(a, derived) for a in args)
    return not isinstance(value, relax.If)   # constants, shapes, prim values


def module_report(mod, functions, log: RuleLog, target: str) -> dict:
    """The report of the named Relax functions of a lowered module."""
    return {"target": target, "functions": {fn: function_report(mod, fn, log) for fn in functions}}
