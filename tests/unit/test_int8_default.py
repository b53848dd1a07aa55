"""Which compiles quantize the CPU linears' inputs to int8 when nothing says (compile/targets.py
Target.int8_by_default): CPU targets with an int8 dot instruction; never a GPU target or a CPU
target without one, where asking for it is an error."""

import pytest

from ds4tvm.artifact import Bounds
from ds4tvm.compile.driver import CompileRequest, _prepared_target
from ds4tvm.compile.targets import resolve
from ds4tvm.errors import Ds4Error


def _resolved(target: str, int8=None) -> bool:
    return _prepared_target(CompileRequest(target, Bounds(), int8_activations=int8))[1].int8_activations


def test_the_default_follows_the_targets_dot_instruction():
    assert CompileRequest("cpu", Bounds()).int8_activations is None   # "the target's default"
    host = resolve("cpu")
    assert _resolved("cpu") is (host.int8_dot() is not None)
    assert _resolved("llvm") is False          # generic x86-64: neither vpdpbusd nor vpmaddubsw
    assert resolve("cuda:sm_90").int8_by_default() is False   # a GPU keeps its own forms
    assert _resolved("cpu", False) is False    # --float-activations


def test_asking_for_int8_where_no_dot_instruction_is_an_error():
    with pytest.raises(Ds4Error, match="--int8-activations: target llvm has neither"):
        _resolved("llvm", True)
