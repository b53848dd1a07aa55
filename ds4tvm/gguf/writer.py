"""GGUF writing, streamed: tensor infos first, then each tensor produced and written in turn, so
converting a large checkpoint never holds more than one tensor in memory."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter

from ..errors import Ds4Error


@dataclass
class TensorOut:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]              # numpy order (..., N, K) of the values
    produce: Callable[[], np.ndarray]   # returns the GGUF data: typed values or uint8 block rows

    @property
    def nbytes(self) -> int:
        bs, ts = GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape, dtype=np.int64)) // bs * ts


class SparseData:
    """Tensor data of `nbytes` bytes: `head` (uint8 or typed values) and zeros after it, the zeros
    written as a hole in the file (no disk blocks where the filesystem has holes): tables far larger
    than what a test should write. The tensor must not be the file's last."""

    def __init__(self, head: np.ndarray, nbytes: int):
        self.head, self.nbytes = np.ascontiguousarray(head), int(nbytes)

    def tofile(self, f) -> None:
        self.head.tofile(f)
        f.seek(self.nbytes - self.head.nbytes, os.SEEK_CUR)


def _value_type(value: Any) -> tuple[GGUFValueType, GGUFValueType | None]:
    if isinstance(value, bool):
        return GGUFValueType.BOOL, None
    if isinstance(value, (int, np.integer)):
        return (GGUFValueType.INT32 if value < 0 else GGUFValueType.UINT32), None
    if isinstance(value, (float, np.floating)):
        return GGUFValueType.FLOAT32, None
    if isinstance(value, str):
        return GGUFValueType.STRING, None
    if isinstance(value, (list, tuple, np.ndarray)):
        items = list(value)
        if not items:
            return GGUFValueType.ARRAY, GGUFValueType.UINT32
        sub, _ = _value_type(items[0])
        if sub in (GGUFValueType.UINT32, GGUFValueType.INT32) and any(int(v) < 0 for v in items):
            sub = GGUFValueType.INT32
        if sub in (GGUFValueType.UINT32, GGUFValueType.INT32) and any(int(v) >= 2 ** 32 for v in items):
            sub = GGUFValueType.UINT64   # PLE hash constants (45-bit multipliers)
        return GGUFValueType.ARRAY, sub
    raise TypeError(f"cannot store {type(value).__name__} in GGUF metadata")


def with_overrides(meta: dict, overrides: dict | None) -> dict:
    """meta with each key of overrides set to its value, or removed where the value is None (the
    random-model writers build malformed files for the tests this way)."""
    out = dict(meta)
    for key, value in (overrides or {}).items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def write_gguf(path: str | os.PathLike, architecture: str, metadata: dict[str, Any],
               tensors: Iterable[TensorOut], progress: bool = False, description: str = "writing") -> Path:
    """Writes a GGUF v3 file. `metadata` maps full key names to values; a value may be given as
    (value, GGUFValueType) to force its type (for a list: its element type). Tensor data are
    produced lazily, one at a time, into PATH.partial, renamed to PATH once complete: a failed
    write leaves no truncated file behind (and an older PATH as it was)."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    tensors = list(tensors)
    w = GGUFWriter(partial, architecture)
    for key, value in metadata.items():
        if key == "general.architecture":
            continue
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], GGUFValueType):
            value, vtype = value
            sub = None
            if isinstance(value, (list, np.ndarray)):  # (values, element type): a typed array
                vtype, sub = GGUFValueType.ARRAY, vtype
        else:
            vtype, sub = _value_type(value)
        if vtype == GGUFValueType.ARRAY:
            w.add_key_value(key, list(value), vtype, sub_type=sub)
        else:
            w.add_key_value(key, value, vtype)
    for t in tensors:
        # GGUFWriter takes the numpy byte shape for block formats and the value shape otherwise.
        bs, ts = GGML_QUANT_SIZES[t.qtype]
        if bs == 1 and t.qtype != GGMLQuantizationType.BF16:
            w.add_tensor_info(t.name, t.shape, _PLAIN_DTYPES[t.qtype], t.nbytes, raw_dtype=t.qtype)
        else:
            byte_shape = (*t.shape[:-1], t.shape[-1] // bs * ts)
            w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), t.nbytes, raw_dtype=t.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    bar = _progress(progress, description, len(tensors))
    done = False
    try:
        for t in tensors:
            data = t.produce()
            data = data if isinstance(data, SparseData) else np.ascontiguousarray(data)
            if data.nbytes != t.nbytes:
                raise Ds4Error(f"tensor {t.name}: produced {data.nbytes} bytes, expected {t.nbytes} "
                               f"for {t.qtype.name} {list(t.shape)}")
            w.write_tensor_data(data)
            bar.advance(t.name)
        done = True
    finally:
        bar.close()
        w.close()
        if done:
            os.replace(partial, path)
        else:
            partial.unlink(missing_ok=True)
    return path


_PLAIN_DTYPES = {
    GGMLQuantizationType.F32: np.dtype(np.float32), GGMLQuantizationType.F16: np.dtype(np.float16),
    GGMLQuantizationType.I32: np.dtype(np.int32), GGMLQuantizationType.I8: np.dtype(np.int8),
    GGMLQuantizationType.I16: np.dtype(np.int16), GGMLQuantizationType.I64: np.dtype(np.int64),
    GGMLQuantizationType.F64: np.dtype(np.float64),
}


class _progress:
    """A rich progress bar over tensors, or nothing when progress is off."""

    def __init__(self, enabled: bool, description: str, total: int):
        self._p = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            self._p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                               TimeElapsedColumn(), TextColumn("{task.fields[name]}"),
                               console=Console(stderr=True), transient=False)
            self._p.start()
            self._task = self._p.add_task(description, total=total, name="")

    def advance(self, name: str) -> None:
        if self._p is not None:
            self._p.update(self._task, advance=1, name=name)

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()
