"""The names and op patterns kernels carry for the schedules that read them: the TVM op pattern a
block presets (schedules/fusion.py's fusion), and the names of the quantized linears' TE blocks that
schedules/llvm.py schedules and dlight's rules recognise."""

ELEMWISE = 0   # tvm's kElemWise
BROADCAST = 1   # tvm's kBroadcast
INJECTIVE = 2   # tvm's kInjective
OPAQUE = 8   # tvm's kOpaque op pattern (hand kernels: scheduled already, never fused)
# A kernel's op pattern set by nn/ where the analysis would find another: AnnotateTIROpPattern
# recomputes every op_pattern that is absent or zero (kElemWise), so it travels in this attribute.
PRESET = "ds4tvm.op_pattern"

# Block names the CPU schedule looks for (schedules/llvm.py), and the GPU forms' (dlight's
# LowBatchGEMV special-cases blocks named "dequantize").
DEQUANT_ROW, ROW_PARTIAL, ROW_MATMUL = "dequant_row", "row_partial", "row_matmul"
EXPERT_PARTIAL, EXPERT_MATMUL = "expert_partial", "expert_matmul"
GPU_DEQUANT, GPU_MATMUL = "dequantize", "matmul"
# The attribute of the kernels that gather a ring's rows (nn/state.gather_context), whose copies
# schedules/llvm.py vectorizes.
GATHER = "ds4tvm.gather"
