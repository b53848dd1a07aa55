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
