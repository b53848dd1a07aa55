"""`ds4-compile --draft-onnx HEADS.onnx`: draft heads a user trained (Medusa-style), imported with
TVM's ONNX frontend and compiled into the artifact beside the target, for any family.

The contract (README): input `hidden`, float32 [n, D], the target's final hidden state (what its
output head reads), one row per position; optional input `tokens`, int64 [n], the token chosen after
each position; output `logits`, float32 [n, K, V], the K positions after that token. n is dynamic,
D and V are the target's, 1 <= K <= max_verify - 1.

How the heads join the artifact:
- large floating-point initializers are weight arguments, written to `draft-onnx.gguf` inside the
  artifact (packages carry and hash it like the model's GGUF); small and integer ones (shapes,
  axes, biases under SMALL) stay constants, which the frontend needs for shape arguments;
- a MatMul of rows [n, K] by a weight (float32, or float16 cast to float32) is rewritten to multiply by its transpose, stored as [N, K]
  (a row per output, as a Gemm with transB keeps it), so that every such product with a weight is
  one "x @ W^T" kernel (products of higher-rank inputs keep TVM's generic matmul): the hand-written F32 linear on CPU targets (kernels/cpu.py), one TE reduction that
  dlight's GEMV / Matmul rules schedule on GPUs (a separate transpose would copy the weight on
  every call, since fusion is off);
- `tokens` is taken as int32, so the engine range-checks it like every token input; Gather indices
  take it as is, any other use gets it cast to int64;
- the function is `draft_onnx`; it takes its own slice of the weight arguments (FunctionSpec.params).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..artifact import file_sha256
from ..errors import Ds4Error

FUNCTION = "draft_onnx"
WEIGHTS_FILE = "draft-onnx.gguf"
ROLE = "draft_onnx"
SMALL = 1024            # initializers with fewer elements stay constants
MIN_OPSET = 13          # the first opset whose Unsqueeze/Split/Reduce* take their axes as inputs
_INPUTS = {"hidden": ("float32", 2), "tokens": ("int64", 1)}
WEIGHT_TYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}   # GGML types they are stored as


@dataclass
class Heads:
    """A checked heads model: K, its input names in graph order, the opset, the file's sha256."""
    model: object
    k: int
    inputs: tuple[str, ...]
    opset: int
    sha256: str


def _fail(path, what: str) -> Ds4Error:
    return Ds4Error(f"{path}: {what}")


def first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]


def read(path: Path, n_embd: int, n_vocab: int, max_verify: int) -> Heads:
    """The heads model at path, checked against the contract and the target (one-line errors)."""
    import onnx

    path = Path(path)
    if not path.is_file():
        raise _fail(path, "no such ONNX file")
    try:
        model = onnx.load(str(path))
    except Exception as e:  # noqa: BLE001 - protobuf raises several types for truncated or foreign files
        raise _fail(path, f"not a readable ONNX model ({first_line(e)})") from None
    try:
        onnx.checker.check_model(model)
    except Exception as e:  # noqa: BLE001
        raise _fail(path, f"the ONNX checker rejects it: {first_line(e)}") from None
    opset = _opset(model, path)
    _check_ops(model, path)
    inputs = _check_inputs(model, path, n_embd)
    k, inferred = _check_output(model, path, n_vocab, max_verify)
    _check_token_tables(model, inferred, path, n_vocab)
    _check_weights(model, path)
    return Heads(model, k, inputs, opset, file_sha256(path))


def _opset(model, path) -> int:
    import onnx

    opset = None
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            opset = o.version
        else:
            raise _fail(path, f"uses operators of the domain {o.domain!r}; expected only the default ONNX domain")
    if opset is None or not MIN_OPSET <= opset <= onnx.defs.onnx_opset_version():
        raise _fail(path, f"opset {opset}: expected {MIN_OPSET}..{onnx.defs.onnx_opset_version()}")
    return opset


def _check_ops(model, path) -> None:
    from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

    known = set(_get_convert_map()) | {"Constant", "If"}   # the two the importer handles itself
    for i, node in enumerate(model.graph.node):
        if node.op_type not in known:
            raise _fail(path, f"node {node.name or f'#{i}'!r} uses the operator {node.op_type}, which TVM's ONNX "
                              f"frontend does not support")


def _dims(value_info) -> list:
    t = value_info.type.tensor_type
    if not t.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in t.shape.dim]


def _dtype(value_info) -> str:
    import onnx

    return str(onnx.helper.tensor_dtype_to_np_dtype(value_info.type.tensor_type.elem_type))


def _check_inputs(model, path, n_embd: int) -> tuple[str, ...]:
    inits = {t.name for t in model.graph.initializer}
    graph_inputs = [i for i in model.graph.input if i.name not in inits]
    names = tuple(i.name for i in graph_inputs)
    for name in names:
        if name not in _INPUTS:
            raise _fail(path, f"input {name!r}: expected only 'hidden' (float32 [n, D]) and 'tokens' (int64 [n])")
    if "hidden" not in names:
        raise _fail(path, "has no input 'hidden' (float32 [n, D]: the target's final hidden state)")
    for vi in graph_inputs:
        dtype, rank = _INPUTS[vi.name]
        dims = _dims(vi)
        if _dtype(vi) != dtype or dims is None or len(dims) != rank:
            raise _fail(path, f"input {vi.name!r} is {_dtype(vi)} {dims}; expected {dtype} of rank {rank}")
        if isinstance(dims[0], int):
            raise _fail(path, f"input {vi.name!r}: dim 0 is fixed at {dims[0]}; expected a dynamic n "
                              f"(torch.onnx.export dynamic_shapes / dynamic_axes)")
        if vi.name == "hidden" and dims[1] != n_embd:
            raise _fail(path, f"input 'hidden' has width {dims[1]}; expected the target's hidden size {n_embd}")
    return names


def _check_output(model, path, n_vocab: int, max_verify: int):
    """K, and the model after shape inference (the token-table check reads its shapes too)."""
    import onnx

    outputs = [o.name for o in model.graph.output]
    if outputs != ["logits"]:
        raise _fail(path, f"outputs {outputs}: expected one output 'logits' (float32 [n, K, V])")
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    except Exception as e:  # noqa: BLE001
        raise _fail(path, f"shape inference fails: {first_line(e)}") from None
    out = inferred.graph.output[0]
    dims = _dims(out)
    if _dtype(out) != "float32" or dims is None or len(dims) != 3:
        raise _fail(path, f"output 'logits' is {_dtype(out)} {dims}; expected float32 [n, K, V]")
    k, v = dims[1], dims[2]
    if not isinstance(k, int) or not isinstance(v, int):
        raise _fail(path, f"output 'logits' {dims}: K and V must be fixed sizes")
    if v != n_vocab:
        raise _fail(path, f"output 'logits' has {v} columns; expected the target's vocabulary of {n_vocab}")
    if not 1 <= k <= max_verify - 1:
        raise _fail(path, f"output 'logits' has K = {k} heads; expected 1..{max_verify - 1} (max-verify - 1)")
    return k, inferred


def _check_weights(model, path) -> None:
    import onnx

    for t in model.graph.initializer:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
        if int(np.prod(t.dims)) >= SMALL and dtype.kind not in "iub" and dtype not in WEIGHT_TYPES:
            raise _fail(path, f"initializer {t.name!r} is {dtype}; expected float32 or float16 weights")


def _check_token_tables(model, inferred, path, n_vocab: int) -> None:
    """A table read by token id (Gather of `tokens`) must have a row for every id the engine lets
    through: the importer's gather does not check its indices."""
    rows = {t.name: (t.dims[0] if t.dims else None) for t in model.graph.initializer}
    for v in inferred.graph.value_info:   # tables computed in the graph
        dims = _dims(v)
        rows.setdefault(v.name, dims[0] if dims and isinstance(dims[0], int) else None)
    for i, node in enumerate(model.graph.node):
        if node.op_type != "Gather" or list(node.input[1:2]) != ["tokens"]:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        n = rows.get(node.input[0])
        if axis != 0 or n is None or n < n_vocab:
            raise _fail(path, f"node {node.name or f'#{i}'!r} gathers {node.input[0]!r} by token id: expected a "
                              f"table of at least {n_vocab} rows on axis 0 (the vocabulary), got "
                              f"{'axis ' + str(axis) if axis else n}")


# ---------------------------------------------------------------------------------------- import
def prepare(model) -> tuple[object, list[tuple[str, np.ndarray]]]:
    """A copy of the model made ready for import (see the module docstring) and its weights, in
    the order the imported function takes them."""
    import onnx
    from onnx import helper, numpy_helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    arrays = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    rhs_only = _matmul_weights(m, arrays)
    head, keep = [], []
    for name, a in arrays.items():
        if a.dtype.kind == "f" and a.size >= SMALL:   # read() let float32 and float16 through
            if name in rhs_only:   # W [K, N] becomes its transpose, read back through a Transpose node
                keep.append((name + ".T", np.ascontiguousarray(a.T)))
                head.append(helper.make_node("Transpose", [name + ".T"], [name], perm=[1, 0]))
            else:
                keep.append((name, a))
            continue
        head.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(a, name)))
    del g.initializer[:]
    g.initializer.extend(numpy_helper.from_array(a, n) for n, a in keep)
    kept = [i for i in g.input if i.name not in arrays]
    del g.input[:]
    g.input.extend(kept)
    for vi in g.input:
        if vi.name != "tokens":
            continue
        vi.type.tensor_type.elem_type = onnx.TensorProto.INT32   # as the engine checks and passes token ids
        if any((n.op_type, list(n.input).index("tokens")) != ("Gather", 1) for n in g.node if "tokens" in n.input):
            # used beyond Gather indices (which take int32 as is, so GPUs index in int32): int64 for the graph
            vi.name = "tokens.int32"
            head.append(helper.make_node("Cast", ["tokens.int32"], ["tokens"], to=onnx.TensorProto.INT64))
    nodes = head + list(g.node)
    del g.node[:]
    g.node.extend(nodes)
    return m, keep


def _matmul_weights(model, arrays) -> set[str]:
    """2-D initializers used only as the right-hand side of MatMuls whose left side is 2-D, directly
    or (float16 ones) through a Cast to float32: the products the x @ W^T kernels take; others
    keep their layout and TVM's generic matmul."""
    import onnx

    g = model.graph
    inferred = onnx.shape_inference.infer_shapes(model).graph
    rank = {v.name: len(v.type.tensor_type.shape.dim) for v in (*inferred.value_info, *inferred.input)
            if v.type.tensor_type.HasField("shape")}
    consumers: dict[str, list] = {}
    for node in g.node:
        for j, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node, j))
    outputs = {o.name for o in g.output}

    def rows_times(name: str) -> bool:
        us = consumers.get(name)
        return bool(us) and name not in outputs and all(
            n.op_type == "MatMul" and j == 1 and rank.get(n.input[0]) == 2 for n, j in us)

    def through_cast(name: str) -> bool:
        us = consumers.get(name, [])
        return (len(us) == 1 and us[0][0].op_type == "Cast" and name not in outputs
                and onnx.helper.get_attribute_value(us[0][0].attribute[0]) == onnx.TensorProto.FLOAT
                and rows_times(us[0][0].output[0]))

    return {name for name, a in arrays.items()
            if a.ndim == 2 and (rows_times(name) or (a.dtype == np.float16 and through_cast(name)))}


def import_function(model):
    """The heads as a Relax function (weights as trailing parameters, no values attached)."""
    import warnings

    from tvm.relax.frontend.onnx import from_onnx

    import tvm
    from tvm.relax import transform

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the frontend warns about every dynamic dimension
        mod = from_onnx(model, keep_params_in_input=True, sanitize_input_names=False)
    # the importer computes static sizes at run time (Gather's index wrap reads the table's shape
    # as an int64 tensor): fold them, so no int64 kernel is left (ROCm and Metal index in int32)
    fold = [transform.CanonicalizeBindings(), transform.FoldConstant()]
    mod = tvm.transform.Sequential([*fold, *fold, transform.DeadCodeElimination(["main"])])(mod)
    return mod["main"].without_attr("params")


def add_to_module(mod, func, cpu: tuple | None = None, gpu_target=None):
    """mod with func as `draft_onnx`, its products with a weight as one x @ W^T kernel each (see
    the module docstring): cpu, the CPU target's (threads, blocking) for the hand-written kernel; else
    a TE kernel, scheduled here for gpu_target by dlight's LowBatchGEMV (the drafter calls the
    heads with one row; the Matmul rule, first in the GPU pipeline's order, would import TVM's
    tensor intrinsics, a minute per compile, for kernels that never see a tile's worth of rows)."""
    from gguf import GGMLQuantizationType as QT
    from tvm import relax, te
    from tvm.relax.dpl import is_op, rewrite_call, wildcard

    from ..kernels import cpu as cpu_kernels

    weights = set(func.params[int(func.attrs["num_input"]):])
    bb = relax.BlockBuilder(mod)
    kernels = {}
    x, w = wildcard(), wildcard()
    transposed = is_op("relax.permute_dims")(w)
    pattern = is_op("relax.matmul")(x, transposed | is_op("relax.astype")(transposed))

    def product(xs, ws, N: int, K: int):
        """xs [n, K] @ ws^T for ws [N, K], float32 or float16 (read as float32)."""
        qtype = QT.F32 if ws.ty.dtype == "float32" else QT.F16
        if cpu is not None and cpu_kernels.supports(qtype, N, K):
            key = (qtype, N, K)
            if key not in kernels:
                kernels[key] = bb.add_func(cpu_kernels.dense_linear(qtype, N, K, *cpu),
                                           f"onnx_linear_{qtype.name.lower()}_{N}x{K}")
            return relax.call_tir(kernels[key], [xs, *cpu_kernels.weight_args([ws])],
                                  relax.TensorType([xs.ty.shape[0], N], "float32"))
        k = te.reduce_axis((0, K), "k")
        return bb.call_te(lambda a, b: te.compute(
            (a.shape[0], N), lambda t, j: te.sum(a[t, k] * b[j, k].astype("float32"), axis=k), name="onnx_linear"),
            xs, ws, primfunc_name_hint="onnx_linear")

    def linear(expr, matched):
        xs, ws = matched[x], matched[w]
        if (ws not in weights or ws.ty.ndim != 2 or ws.ty.dtype not in ("float32", "float16") or xs.ty.ndim != 2
                or expr.ty.dtype != "float32"):
            return expr
        N, K = (int(d) for d in ws.ty.shape)
        return product(xs, ws, N, K)

    rewritten = rewrite_call(pattern, linear, func)
    out = bb.get()
    out[FUNCTION] = rewritten.with_attr("global_symbol", FUNCTION)
    if gpu_target is not None:
        _schedule_gpu_linears(out, gpu_target)
    return out


def _schedule_gpu_linears(mod, target) -> None:
    from tvm.s_tir import dlight as dl

    with target:
        for gv, f in list(mod.functions.items()):
            if gv.name_hint.startswith("onnx_linear"):
                sch = dl.gpu.LowBatchGEMV(4).apply(f, target, False)
                if sch is not None:
                    mod[gv] = sch.mod["main"].with_attr("tirx.is_scheduled", True)


def write_weights(path: Path, keep: list[tuple[str, np.ndarray]], source_sha256: str) -> list[str]:
    """The heads' weights as a GGUF (F32 or F16 tensors `onnx.N`, their ONNX names in the
    metadata); returns the tensor names in argument order."""
    from gguf import GGMLQuantizationType as QT

    from ..gguf.writer import TensorOut, write_gguf

    tensors = [TensorOut(f"onnx.{i}", getattr(QT, WEIGHT_TYPES[a.dtype]), a.shape, lambda a=a: a)
               for i, (name, a) in enumerate(keep)]
    write_gguf(path, "ds4tvm-onnx-heads", {"ds4tvm.onnx.names": [n for n, _ in keep],
                                          "ds4tvm.onnx.source_sha256": source_sha256}, tensors)
    return [t.name for t in tensors]
