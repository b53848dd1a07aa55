"""Which kernels a module's blocks emit for a target: the CPU's hand-written linears, the GPU forms,
or plain TE kernels. compile/targets.Target.forms builds one from the target's facts; a family's
builder sets it on every module (nn/forms.assign) and each block with several forms reads it at
its one dispatch point, from the module (`self.forms`) or its `forms` argument."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # this module is read by the families' contract, which loads without TVM's compiler
    from gguf import GGMLQuantizationType as QT

    from .cpu import Blocking


@dataclass(frozen=True)
class CpuLinears:
    """The CPU's hand-written linears (kernels/cpu.py): the cores they are compiled for, the
    register blocking their vectors take and, where inputs are quantized to int8, the dot
    instruction they feed (kernels/cpu_int8.py); interleaved: whether the weights kernels/
    cpu_interleaved.py takes are laid out for it (off only to measure against the row-major ones)."""
    threads: int
    blocking: Blocking
    int8_dot: str | None = None
    interleaved: bool = True


@dataclass(frozen=True)
class Forms:
    """gpu: the GPU forms (every linear a `dequantize` block feeding one reduction over K, the form
    dlight's rules take; hand kernels for what they would split into several launches). on_gpu:
    whether those bind GPU threads; False runs the same loops serially on a CPU, to check their
    numerics there. cpu_linears: the CPU's hand-written linears, for a CPU target. Neither: TE
    kernels only (what the tests of single blocks compile)."""
    gpu: bool = False
    on_gpu: bool = True
    cpu_linears: CpuLinears | None = None

    def __post_init__(self):
        if self.gpu and self.cpu_linears is not None:
            raise ValueError("Forms: the GPU forms and the CPU's hand-written linears are exclusive")

    @property
    def binds_threads(self) -> bool:
        """Whether hand-written GPU kernels bind GPU threads (not when the GPU forms run on a CPU)."""
        return not self.gpu or self.on_gpu

    @property
    def for_cpu(self) -> bool:
        """Whether the module is exported for a CPU target with its hand-written linears."""
        return self.cpu_linears is not None

    def cpu_linear(self, qtype: QT, K: int, few: bool = False) -> tuple:
        """(threads, blocking, int8 dot) of a linear of this format and width on the CPU's
        hand-written kernels (int8 None where the int8 path does not take it); threads None when
        the module is not exported for a CPU. A call of a few tokens (nn/state.few_rows: a decode,
        a batched decode, a verify) takes its rows one after another (rows=1): a core then reads
        one sequential stream, which the hardware prefetcher follows, where rows read side by side
        (512 bytes apart at K = 512) left one-token calls at half the memory's speed (a Q8_0
        linear read from memory: int8 13 -> 24 GB/s, experts 14 -> 27 GB/s; BENCHMARKS.md), and
        the few tokens share each row's weights (from the cache after the first token block): on
        the benchmark model's Q8_0 output head a batch of 2 took 2.7x one token's time with rows
        side by side, a batch of 4 1.8x in one stream. A token's sums do not depend on the
        blocking, so decode and verify still round alike."""
        c = self.cpu_linears
        if c is None:
            return None, None, None
        from .cpu import takes_int8

        blocking = replace(c.blocking, rows=1) if few else c.blocking
        return c.threads, blocking, c.int8_dot if c.int8_dot and takes_int8(qtype, K, c.int8_dot) else None


TE = Forms()
