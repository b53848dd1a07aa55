"""schedules/report.device_launches: the device kernels a scheduled PrimFunc becomes."""

from tvm.script import tirx as T

from ds4tvm.schedules.report import device_launches


@T.prim_func(s_tir=True)
def two_stages(x: T.Buffer((64,), "float32"), y: T.Buffer((1,), "float32"), z: T.Buffer((64,), "float32")):
    for b in T.thread_binding(1, thread="blockIdx.x"):   # a reduction, then its consumer: two launches
        for t in T.thread_binding(64, thread="threadIdx.x"):
            with T.sblock("sum"):
                T.reads(x[t])
                T.writes(y[0])
                y[0] = y[0] + x[t]
    for b in T.thread_binding(2, thread="blockIdx.x"):
        for t in T.thread_binding(32, thread="threadIdx.x"):
            with T.sblock("scale"):
                T.reads(x[b * 32 + t], y[0])
                T.writes(z[b * 32 + t])
                z[b * 32 + t] = x[b * 32 + t] / y[0]


@T.prim_func(s_tir=True)
def branches(x: T.Buffer((64,), "float32"), n: T.int64):
    if n > 8:   # one branch runs: the larger one counts
        for b in T.thread_binding(64, thread="blockIdx.x"):
            x[b] = x[b] + T.float32(1)
        for b in T.thread_binding(64, thread="blockIdx.x"):
            x[b] = x[b] * T.float32(2)
    else:
        for b in T.thread_binding(64, thread="blockIdx.x"):
            x[b] = T.float32(0)


@T.prim_func(s_tir=True)
def on_cpu(x: T.Buffer((64,), "float32")):
    for i in T.parallel(64):
        x[i] = T.float32(0)


def test_device_launches_count_outermost_thread_nests():
    assert device_launches(two_stages) == 2
    assert device_launches(branches) == 2
    assert device_launches(on_cpu) == 1


def test_output_copies_are_one_launch_on_gpus_and_copy_on_a_cpu():
    """schedules/graphs._copies: every output a recorded function returns, copied by one kernel
    (dlight's Fallback made one launch per tensor); built serial for llvm, it copies."""
    import numpy as np
    import tvm

    from ds4tvm.schedules.graphs import _copies

    shapes = [(1, 300), (2, 5, 7)]
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90"}):
        assert device_launches(_copies(shapes, ["float32", "int32"], "copies")) == 1
    with tvm.target.Target({"kind": "llvm"}):
        func = _copies(shapes, ["float32", "int32"], "copies")
    lib = tvm.compile(tvm.IRModule({"copies": func}), target="llvm")
    a, b = np.random.default_rng(0).standard_normal(shapes[0]).astype("float32"), np.arange(70, dtype="int32").reshape(shapes[1])
    outs = [tvm.runtime.tensor(np.zeros_like(a)), tvm.runtime.tensor(np.zeros_like(b))]
    lib["copies"](tvm.runtime.tensor(a), tvm.runtime.tensor(b), *outs)
    assert np.array_equal(outs[0].numpy(), a) and np.array_equal(outs[1].numpy(), b)
