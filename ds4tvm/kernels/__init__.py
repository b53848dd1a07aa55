"""Hand-written TIR: the CPU linears (cpu, cpu_int8), the GPU kernels (gpu), the dequantization
expressions every path shares (dequant), and the scalar expressions the TE blocks of nn/ and these
kernels both build from (slots, minifloat). Nothing here builds a graph: nn/ does, choosing among
these by its Forms (forms.py)."""
