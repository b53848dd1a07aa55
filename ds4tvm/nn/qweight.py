"""Weights stored as GGUF planes and read, element by element, inside TE kernels.

A `QWeight` holds one plane parameter per field of its GGML format (see gguf/quant.py); the
`dequant` expressions below give the float32 value of element (row..., k) from those planes with
the same float operations as gguf's numpy dequantizer, so no fp32 copy of a weight exists.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as QT
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from ..kernels import cpu as cpu_kernels
from ..kernels import cpu_interleaved
from ..kernels import gpu as gpu_kernels
from ..kernels.dequant import DEQUANT, tables
from ..kernels.forms import TE, Forms
from ..kernels.tags import (DEQUANT_ROW, EXPERT_MATMUL, EXPERT_PARTIAL, GPU_DEQUANT, GPU_MATMUL, INJECTIVE, PRESET,
                           ROW_MATMUL, ROW_PARTIAL)
from ..gguf.quant import INTERLEAVED, TO_F32, plane_format
from .state import few_rows

F32 = "float32"


LANES = 16  # partial sums per output, a 512-bit vector of float32


def _dequantized(P: dict, deq, shape: tuple, row, gpu: bool) -> "te.Tensor":
    """The weight [*shape] as float32 from its planes, row(*i) giving the plane row of index i: a
    block the CPU schedule computes one row at a time (never a whole fp32 weight), which the GPU
    rules inline into the product."""
    name = GPU_DEQUANT if gpu else DEQUANT_ROW
    return te.compute(shape, lambda *i: deq(P, row(*i[:-1]), i[-1]), name=name)


def _product(x_te, w, rows: tuple, K: int, x_at, gpu: bool):
    """y[t, rows...] = sum_k x_at(t, rows, k) * w[rows..., k]: the CPU's two-stage form, or the GPU's
    one reduction over K."""
    if not gpu:
        return _row_matmul(x_te, w, rows, K, x_at)
    k = te.reduce_axis((0, K), name="k")
    return te.compute((x_te.shape[0], *rows), lambda t, *r: te.sum(x_at(t, r, k) * w[(*r, k)], axis=k),
                      name=GPU_MATMUL)


def _row_matmul(x_te, w, rows: tuple, K: int, x_at):
    """y[t, rows...] = sum_k x_at(t, rows, k) * w[rows..., k] in two stages: LANES partial sums over
    strided k (a vectorisable inner loop), then their sum."""
    lanes = LANES if K % LANES == 0 and K > LANES else 1   # one lane block: its loop folds away
    ko = te.reduce_axis((0, K // lanes), name="ko")

    def partial(t, *r):
        k = ko * lanes + r[-1]
        return te.sum(x_at(t, r[:-1], k) * w[(*r[:-1], k)], axis=ko)

    part = te.compute((x_te.shape[0], *rows, lanes), partial, name=ROW_PARTIAL)
    li = te.reduce_axis((0, lanes), name="li")
    return te.compute((x_te.shape[0], *rows), lambda t, *r: te.sum(part[(t, *r, li)], axis=li), name=ROW_MATMUL)


class QWeight(nn.Module):
    """A GGUF tensor kept in its format: numpy shape (..., N, K) as planes."""

    def __init__(self, gguf_name: str, qtype: QT, shape: tuple[int, ...], forms: Forms = TE):
        self.gguf_name, self.qtype, self.shape = gguf_name, QT(qtype), tuple(shape)
        fmt = plane_format(self.qtype)
        if self.qtype not in DEQUANT:
            raise ValueError(f"no kernel reads {self.qtype.name} planes")
        self.fields = [f.name for f in fmt.fields]
        # what the runtime derives a plane by at load (gguf.quant.derived_plane): HOST_DERIVED of an
        # F32 plane, TO_F32, or INTERLEAVED (set by the forms)
        self.derive = None
        self._lay_out(None)
        self.forms = forms   # the target's (set_forms): which kernels its products take and the planes' layout
        if len(self.shape) == 1:   # a vector (norm, gate, bias) is only ever read whole
            self.read_as_float32()

    @property
    def forms(self) -> Forms:
        return self._forms

    @forms.setter
    def forms(self, forms: Forms) -> None:
        """The target's forms, and with them the planes' layout: the weights kernels/cpu_interleaved.py
        multiplies (its formats, on AVX-512 VNNI) are bound 16 rows interleaved."""
        self._forms = forms
        if self.derive in (None, INTERLEAVED):
            self._lay_out(INTERLEAVED if cpu_interleaved.takes(self.qtype, self.shape, forms) else None)

    def _lay_out(self, derive: str | None) -> None:
        if derive == INTERLEAVED:
            shapes = cpu_interleaved.plane_shapes(self.qtype, self.shape)
        else:
            *lead, K = self.shape
            shapes = {f.name: ((*lead, f.per_row(K)), f.dtype) for f in plane_format(self.qtype).fields}
        if self.derive != derive or not hasattr(self, f"plane_{self.fields[0]}"):
            for name, (shape, dtype) in shapes.items():
                setattr(self, f"plane_{name}", nn.Parameter(shape, dtype))
        self.derive = derive

    @property
    def _deq(self):
        """The TE kernels' expression of an element from the planes as laid out."""
        return cpu_interleaved.dequant_for(self.qtype) if self.derive == INTERLEAVED else DEQUANT[self.qtype]

    def planes(self) -> list[nn.Tensor]:
        return [getattr(self, f"plane_{n}") for n in self.fields]

    def read_as_float32(self) -> "QWeight":
        """Binds an F16 / BF16 tensor as its float32 values, converted once at load (gguf.quant.TO_F32)
        instead of by a kernel every call: for small tensors a family reads only through values()."""
        if self.qtype in (QT.F16, QT.BF16):
            self.plane_w = nn.Parameter(self.shape, F32)
            self.derive = TO_F32
        return self

    def _check_planes(self) -> None:
        if self.derive == TO_F32:
            raise ValueError(f"{self.gguf_name}: bound as float32 values (read_as_float32); read it with values()")

    def _te_args(self):
        self._check_planes()
        consts = tables(self.qtype)
        return self.planes() + [nn.Tensor.from_const(v) for v in consts.values()], self.fields + list(consts)

    def _cpu_args(self, int8: str | None) -> list[nn.Tensor]:
        self._check_planes()
        consts = cpu_kernels.kernel_tables(self.qtype, int8)
        return cpu_kernels.weight_args(self.planes() + [nn.Tensor.from_const(v) for v in consts.values()])

    def _cpu_dense(self, n_tok, groups: int):
        """(kernel, weight arguments) of a CPU hand-written dense linear of n_tok tokens, or None."""
        N, K = self.shape
        few = few_rows(n_tok)
        threads, blocking, int8 = self.forms.cpu_linear(self.qtype, K, few)
        if self.derive == INTERLEAVED:   # its planes are for kernels/cpu_interleaved.py (or the TE kernels) only
            return (cpu_interleaved.dense_linear(self.qtype, N, K, threads, few, groups), self._interleaved_args()) \
                if cpu_interleaved.supports(N, K, groups) else None
        if threads is not None and cpu_kernels.supports(self.qtype, N, K, groups):
            return cpu_kernels.dense_linear(self.qtype, N, K, threads, blocking, groups, int8), self._cpu_args(int8)
        return None

    def _interleaved_args(self) -> list[nn.Tensor]:
        consts = cpu_interleaved.tables(self.qtype)
        return cpu_interleaved.weight_args(self.planes() + [nn.Tensor.from_const(v) for v in consts.values()])

    def linear(self, x: nn.Tensor, name: str = "qlinear") -> nn.Tensor:
        """y[t, n] = sum_k x[t, k] * W[n, k] for x of shape [T, K]."""
        N, K = self.shape
        cpu = self._cpu_dense(x.shape[0], 1)
        if cpu is not None:
            return op.tensor_ir_op(cpu[0], name, [x, *cpu[1]], nn.Tensor.placeholder((x.shape[0], N), F32))
        args, names = self._te_args()
        deq = self._deq

        def f(x_te, *ps):
            # Row n is dequantized once (schedules/llvm.py computes it inside the n loop, into a
            # K-value buffer) and used by every token: a verify or prefill reads each weight once.
            w = _dequantized(dict(zip(names, ps)), deq, (N, K), lambda n: (n,), self.forms.gpu)
            return _product(x_te, w, (N,), K, lambda t, r, k: x_te[t, k], self.forms.gpu)

        return op.tensor_expr_op(f, name, [x, *args])

    def linear_and_squares(self, x: nn.Tensor, name: str = "qlinear") -> nn.Tensor:
        """The GPU forms' [T, N + 1]: linear(x), then sum_k x[t, k]^2 in the last column: a norm's
        sum of squares taken by the GEMV that reads x anyway, as one more output row."""
        N, K = self.shape
        args, names = self._te_args()
        deq = self._deq

        def f(x_te, *ps):
            P = dict(zip(names, ps))
            w = te.compute((x_te.shape[0], N + 1, K), lambda t, n, k: tirx.if_then_else(
                n < N, deq(P, (tirx.min(n, N - 1),), k), x_te[t, k]), name=GPU_DEQUANT)
            k = te.reduce_axis((0, K), name="k")
            return te.compute((x_te.shape[0], N + 1), lambda t, n: te.sum(x_te[t, k] * w[t, n, k], axis=k),
                              name=GPU_MATMUL)

        return op.tensor_expr_op(f, name, [x, *args])

    def grouped_linear(self, x: nn.Tensor, groups: int, name: str = "qlinear_grouped") -> nn.Tensor:
        """x [T, G, Kg] -> y [T, G, N/G]: group g uses rows g*N/G.. of W (columns are Kg wide)."""
        N, K = self.shape
        No = N // groups
        cpu = self._cpu_dense(x.shape[0], groups)
        if cpu is not None:
            T = x.shape[0]
            y = op.tensor_ir_op(cpu[0], name, [op.reshape(x, (T, groups * K)), *cpu[1]],
                                nn.Tensor.placeholder((T, N), F32))
            return op.reshape(y, (T, groups, No))
        args, names = self._te_args()
        deq = self._deq

        def f(x_te, *ps):
            w = _dequantized(dict(zip(names, ps)), deq, (groups, No, K), lambda g, o: (g * No + o,), self.forms.gpu)
            return _product(x_te, w, (groups, No), K, lambda t, r, k: x_te[t, r[0], k], self.forms.gpu)

        return op.tensor_expr_op(f, name, [x, *args])

    def expert_linear(self, x: nn.Tensor, experts: nn.Tensor, name: str = "qlinear_experts") -> nn.Tensor:
        """y[t, j, n] = sum_k x[t(, j), k] * W[experts[t, j], n, k]: only the chosen experts' rows
        are read. x is [T, K] (shared by the chosen experts) or [T, J, K]."""
        E, N, K = self.shape
        per_expert_input = len(x.shape) == 3
        T, J = x.shape[0], experts.shape[1]
        few = few_rows(T)
        threads, blocking, int8 = self.forms.cpu_linear(self.qtype, K, few)
        blockized = self.forms.gpu and gpu_kernels.takes_blockized(self.qtype, K)
        if self.derive == INTERLEAVED:
            func = cpu_interleaved.expert_linear(self.qtype, E, N, K, J, per_expert_input, threads, few)
            xs = x if per_expert_input else op.reshape(x, (T, 1, K))
            return op.tensor_ir_op(func, name, [xs, experts, *self._interleaved_args()],
                                   nn.Tensor.placeholder((T, J, N), F32))
        if blockized or (threads is not None and cpu_kernels.takes_experts(self.qtype, N, K, T, int8)):
            func = (gpu_kernels.expert_gemv(self.qtype, E, N, K, J, per_expert_input, self.forms.on_gpu) if blockized
                    else cpu_kernels.expert_linear(self.qtype, E, N, K, J, per_expert_input, threads, blocking,
                                                   int8))
            xs = x if per_expert_input else op.reshape(x, (T, 1, K))
            return op.tensor_ir_op(func, name, [xs, experts, *self._cpu_args(int8)],
                                   nn.Tensor.placeholder((T, J, N), F32))
        args, names = self._te_args()
        deq = self._deq

        def f(x_te, ids, *ps):
            P = dict(zip(names, ps))
            if self.forms.gpu:   # the flat GPU form, one (token, slot) pair per output row
                return self._flat_experts(P, x_te, ids, per_expert_input)
            lanes = LANES if K % LANES == 0 and K > LANES else 1   # one lane block: its loop folds away
            ko = te.reduce_axis((0, K // lanes), name="ko")

            def partial(t, j, n, lane):
                k = ko * lanes + lane
                xv = x_te[t, j, k] if per_expert_input else x_te[t, k]
                return te.sum(xv * deq(P, (ids[t, j], n), k), axis=ko)

            part = te.compute((ids.shape[0], ids.shape[1], N, lanes), partial, name=EXPERT_PARTIAL)

            def fold(t, j, n):   # the lanes summed in halves, as the CPU kernels of kernels/cpu.py do
                v = [part[t, j, n, lane] for lane in range(lanes)]
                while len(v) > 1:
                    v = [a + b for a, b in zip(v[:len(v) // 2], v[len(v) // 2:])]
                return v[0]

            return te.compute((ids.shape[0], ids.shape[1], N), fold, name=EXPERT_MATMUL)

        return op.tensor_expr_op(f, name, [x, experts, *args])

    def _flat_experts(self, P: dict, x_te, ids, per_expert_input: bool):
        """The flat GPU form's product [T, J, N] (a `dequantize` block inlined into one `matmul`
        reduction over K: schedules/gpu.py's HandGEMV)."""
        E, N, K = self.shape
        J = ids.shape[1]
        w = _dequantized(P, self._deq, (ids.shape[0], J, N, K), lambda t, j, n: (ids[t, j], n), True)
        k = te.reduce_axis((0, K), name="k")
        return te.compute((ids.shape[0], J, N), lambda t, j, n: te.sum(
            (x_te[t, j, k] if per_expert_input else x_te[t, k]) * w[t, j, n, k], axis=k), name=GPU_MATMUL)

    def expert_swiglu(self, gate: nn.Tensor, x: nn.Tensor, experts: nn.Tensor, limit: float,
                      name: str = "qlinear_experts_swiglu") -> nn.Tensor | None:
        """The GPU forms' clamped SwiGLU of gate [T, J, N] and this up projection's
        expert_linear(x [T, K], experts) as one kernel (the SwiGLU the GEMV's epilogue, in the
        blockized or the flat form); None on the CPU."""
        E, N, K = self.shape
        if not self.forms.gpu or len(x.shape) != 2:
            return None
        if not gpu_kernels.takes_blockized(self.qtype, K):
            args, names = self._te_args()

            def f(x_te, ids, g, *ps):
                up = self._flat_experts(dict(zip(names, ps)), x_te, ids, False)
                return te.compute(up.shape, lambda *i: gpu_kernels.clamped_swiglu_value(g[i], up[i], limit),
                                  name="swiglu")

            return op.tensor_expr_op(f, name, [x, experts, gate, *args])
        T, J = x.shape[0], experts.shape[1]
        func = gpu_kernels.expert_gemv_swiglu(self.qtype, E, N, K, J, float(limit), self.forms.on_gpu)
        return op.tensor_ir_op(func, name, [op.reshape(x, (T, 1, K)), experts, *self._cpu_args(None), gate],
                               nn.Tensor.placeholder((T, J, N), F32))

    def rows(self, ids: nn.Tensor, name: str = "qrows") -> nn.Tensor:
        """Rows ids[t] of W as float32 [T, K] (embedding lookup)."""
        N, K = self.shape
        args, names = self._te_args()
        deq = self._deq

        def f(ids_te, *ps):
            P = dict(zip(names, ps))
            return te.compute((ids_te.shape[0], K), lambda t, k: deq(P, (ids_te[t],), k), name="qrows")

        # a gather, which the pattern analysis calls opaque: injective, it fuses with what follows
        attrs = {PRESET: INJECTIVE} if self.forms.gpu else None
        return op.tensor_expr_op(f, name, [ids, *args], attrs=attrs)

    def values(self, name: str = "qvalues") -> nn.Tensor:
        """The whole (small) tensor as float32: norms, biases, HC vectors. An F32 tensor is its one
        plane, read as it is: a kernel that only copied a weight would run every step."""
        if self.qtype == QT.F32 or self.derive == TO_F32:
            return self.planes()[0]
        args, names = self._te_args()
        deq = self._deq
        *lead, K = self.shape

        def f(*ps):
            P = dict(zip(names, ps))
            return te.compute(self.shape, lambda *idx: deq(P, tuple(idx[:-1]), idx[-1]), name="qvalues")

        return op.tensor_expr_op(f, name, args)


class Weights:
    """QWeights of one prefix, created on demand from a family's tensor table (name -> TensorSpec)
    and the file's types, each set as an attribute of `owner` so that it is one of its parameters."""

    def __init__(self, owner: nn.Module, specs: dict, types: dict, prefix: str):
        self.owner, self.specs, self.types, self.prefix = owner, specs, types, prefix

    def __call__(self, short: str) -> QWeight:
        name = self.prefix + short
        spec = self.specs[name]
        w = QWeight(name, self.types[name], tuple(reversed(spec.shape)))
        setattr(self.owner, short.replace(".", "_"), w)
        return w


def parameter_sources(model: nn.Module, drafter_role: str = "support") -> dict[int, tuple[str, str | None, str]]:
    """id(Parameter) -> (GGUF tensor, plane field or None for a tensor passed as is, weight file
    role): the planes of every QWeight, the tensors a module lists in `raw_tensors` (GGUF name ->
    Parameter), and the weights of a `drafter` submodule from the support file."""
    from ..artifact import MODEL

    out = {}
    stack = [(model, MODEL)]
    while stack:
        m, role = stack.pop()
        if isinstance(m, QWeight):
            for f in m.fields:
                out[id(getattr(m, f"plane_{f}"))] = (m.gguf_name, f if m.derive is None else f"{f}:{m.derive}", role)
            continue
        for name, param in getattr(m, "raw_tensors", {}).items():
            out[id(param)] = (name, None, role)
        for name, v in vars(m).items():
            sub = drafter_role if name == "drafter" else role
            if isinstance(v, nn.ModuleList):
                stack.extend((x, sub) for x in v)
            elif isinstance(v, nn.Module):
                stack.append((v, sub))
    return out


def set_forms(model: nn.Module, forms: Forms) -> nn.Module:
    """model with `forms` set on it and on every module it holds (as attributes, in module lists,
    dicts, lists and tuples): what each block reads to pick its kernels for the target."""
    seen, stack = set(), [model]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if isinstance(m, nn.Module):
            m.forms = forms
            stack.extend(vars(m).values())
        elif isinstance(m, (list, tuple)):
            stack.extend(m)
        elif isinstance(m, dict):
            stack.extend(m.values())
    return model
