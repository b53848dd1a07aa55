"""GGUF reading, validation, quantized planes and writing."""

from .reader import GGUFFile, TensorInfo, open_gguf  # noqa: F401
