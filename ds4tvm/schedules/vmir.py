"""What schedules/graphs.py and schedules/report.py both read of a compiled Relax module: the VM
built-ins its bindings call and how many leading parameters of a function are inputs."""

from __future__ import annotations

GRAPH_CALL = "vm.builtin.cuda_graph.run_or_capture"
NUM_ARGS = "ds4.num_args"


def num_args(func) -> int:
    """How many leading parameters are the function's inputs (ids, position, states...), the rest
    being weights: its num_input, or for a function rewritten here the inputs it had (the states
    tuple counted per tensor)."""
    attrs = func.attrs or {}
    return int(attrs[NUM_ARGS]) if NUM_ARGS in attrs else int(attrs["num_input"])


def builtin_of(v) -> str | None:
    """The VM built-in a call runs (R.call_packed, R.call_builtin_with_ctx and the like), if any."""
    from tvm import relax

    if isinstance(v.op, relax.ExternFunc):
        return v.op.global_symbol
    if v.args and isinstance(v.args[0], relax.ExternFunc):
        return v.args[0].global_symbol
    return None


def calls_builtin(v, name: str) -> bool:
    """Whether binding value v is a call of the VM built-in `name`."""
    from tvm import relax

    return isinstance(v, relax.Call) and builtin_of(v) == name
