"""GGUF reading: a thin, validating wrapper over `gguf.GGUFReader` (mmap, tensors are never copied).

Every problem with a file becomes a one-line `Ds4Error` naming the file and the key or tensor at
fault, so that the CLI can print it and exit 2 instead of showing a numpy or struct traceback.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField

from ..errors import Ds4Error

GGUF_MAGIC = 0x46554747  # b"GGUF" read as little-endian u32
SUPPORTED_VERSIONS = (2, 3)
_MISSING = object()

_INT_TYPES = {GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
              GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64}
_FLOAT_TYPES = {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64}
# What each requested kind accepts; an integer is a fine float (converters write 16 for 16.0).
_KINDS = {
    "int": (_INT_TYPES, "an integer"),
    "float": (_FLOAT_TYPES | _INT_TYPES, "a number"),
    # gguf-py writes a list of Python ints 0/1 as INT32; llama.cpp's array reader converts them
    "bool": ({GGUFValueType.BOOL} | _INT_TYPES, "a boolean"),
    "str": ({GGUFValueType.STRING}, "a string"),
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF. `shape` is in ggml order (shape[0] is the row length)."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    offset: int
    data: np.ndarray  # a view into the mmap: float/int dtypes for plain types, uint8 rows otherwise

    @property
    def type_name(self) -> str:
        return self.ggml_type.name


class _CheckedReader(GGUFReader):
    """GGUFReader that checks each tensor's type, block alignment and data range before the
    base class slices the mmap, so the error can name the tensor."""

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        # gguf-py makes two numpy views per array element, which takes seconds for a 150k-token
        # vocabulary. Arrays of numbers become one view; arrays of strings one memoryview each.
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        if len(raw_itype) != 1 or len(alen) != 1:
            raise ValueError("array header runs past the end of the file")
        itype, count = GGUFValueType(int(raw_itype[0])), int(alen[0])
        offs = orig_offs + 12
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:
            values = self._get(offs, nptype, count)
            if len(values) != count:
                raise ValueError("array runs past the end of the file")
            return 12 + int(values.nbytes), [raw_itype, alen, values], [2], [GGUFValueType.ARRAY, itype]
        if itype != GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        mv, end = memoryview(self.data), len(self.data)
        parts: list = [raw_itype, alen]
        for _ in range(count):
            if offs + 8 > end:
                raise ValueError("string array runs past the end of the file")
            n = int.from_bytes(mv[offs:offs + 8], "little")
            if offs + 8 + n > end:
                raise ValueError("string array runs past the end of the file")
            parts.append(mv[offs + 8:offs + 8 + n])
            offs += 8 + n
        return offs - orig_offs, parts, list(range(2, 2 + count)), [GGUFValueType.ARRAY, itype]

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        size = len(self.data)
        for field in fields:
            _, name_data, _, dims, raw_dtype, offset_tensor = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            try:
                qtype = GGMLQuantizationType(int(raw_dtype[0]))
            except ValueError:
                raise Ds4Error(f"tensor {name} has unknown GGML type id {int(raw_dtype[0])}") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            dims = [int(d) for d in dims]
            if not dims or any(d <= 0 for d in dims):
                raise Ds4Error(f"tensor {name} has invalid dimensions {dims}")
            if dims[0] % block:
                raise Ds4Error(f"tensor {name}: row length {dims[0]} is not a multiple of the "
                               f"{qtype.name} block size {block}")
            n_bytes = int(np.prod(dims, dtype=object)) // block * type_size
            begin = start_offs + int(offset_tensor[0])
            if begin + n_bytes > size:
                raise Ds4Error(f"tensor {name}: data [{begin}, {begin + n_bytes}) lies past the end "
                               f"of the file ({size} bytes); the file is truncated or corrupt")
        super()._build_tensors(start_offs, fields)


def _describe(field: ReaderField) -> str:
    types = [t.name for t in field.types]
    return "ARRAY of " + types[1] if len(types) > 1 and types[0] == "ARRAY" else types[0]


class GGUFFile:
    """An open GGUF file: typed metadata (with the architecture prefix) and mmap'd tensors."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.name = str(path)
        self._check_header()
        try:
            self._reader = _CheckedReader(self.path, "r")
        except Ds4Error as e:
            raise Ds4Error(f"{self.name}: {e.message}") from None
        except (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError,
                struct.error, MemoryError, RecursionError) as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise Ds4Error(f"{self.name}: truncated or corrupt GGUF header (metadata or tensor "
                           f"infos could not be read: {reason[:120]})") from None
        self.file_bytes = self.path.stat().st_size
        self.tensors: dict[str, TensorInfo] = {}
        self.layout_notes: dict[str, str] = {}   # tensor -> how it is stored, when not as expected
        for t in self._reader.tensors:
            self.tensors[t.name] = TensorInfo(
                t.name, t.tensor_type, tuple(int(d) for d in t.shape), int(t.n_elements),
                int(t.n_bytes), int(t.data_offset), t.data)
        self._check_strings()
        # ds4 treats a file without general.architecture as deepseek4.
        self.architecture = self.get("general.architecture", "str", default="deepseek4")

    def _check_strings(self) -> None:
        """Every string in the metadata is UTF-8, checked once at open: a bad byte is one line naming
        its key, not a traceback from whatever reads the key first (after a compile, say)."""
        for field in self._reader.fields.values():
            if field.types[-1:] != [GGUFValueType.STRING]:
                continue
            for i in field.data:
                try:
                    bytes(field.parts[i]).decode("utf-8")
                except UnicodeDecodeError as e:
                    raise Ds4Error(f"{self.name}: metadata key {field.name} holds a string that is not "
                                   f"valid UTF-8 (byte {e.start})") from None

    def release_pages(self) -> None:
        """Drop the file's pages from this process's resident memory once the weights have been
        made into planes or copied to the device: they stay in the page cache and are read again
        if touched, but no longer count twice in the process's footprint."""
        m = getattr(self._reader.data, "_mmap", None)
        if m is not None and hasattr(mmap, "MADV_DONTNEED"):
            m.madvise(mmap.MADV_DONTNEED)

    def _check_header(self) -> None:
        if not self.path.exists():
            raise Ds4Error(f"{self.name}: no such file")
        if self.path.is_dir():
            raise Ds4Error(f"{self.name}: is a directory, expected a .gguf file")
        size = self.path.stat().st_size
        if size == 0:
            raise Ds4Error(f"{self.name}: empty file, expected a GGUF file")
        if size < 24:
            raise Ds4Error(f"{self.name}: {size} bytes is too short for a GGUF header (24 bytes)")
        with open(self.path, "rb") as f:
            magic, version = struct.unpack("<II", f.read(8))
        if magic != GGUF_MAGIC:
            raise Ds4Error(f"{self.name}: not a GGUF file (magic {magic:#010x}, expected 'GGUF')")
        if version not in SUPPORTED_VERSIONS:
            raise Ds4Error(f"{self.name}: GGUF version {version} is not supported (expected 2 or 3)")

    # ------------------------------------------------------------------ metadata
    def key(self, name: str) -> str:
        """`block_count` -> `deepseek4.block_count`; dotted names (`general.x`) stay as they are."""
        return name if "." in name and name.split(".", 1)[0] in ("general", "tokenizer") \
            else f"{self.architecture}.{name}"

    def has(self, name: str) -> bool:
        return self._reader.get_field(name) is not None

    def get(self, name: str, kind: str, default: Any = _MISSING, aliases: Iterable[str] = ()) -> Any:
        """Typed value of a key. `kind` is int, float, bool, str, or one of those plus "s" for an
        array (`ints`, `floats`, `strs`). Aliases are tried in order after the first name; names
        are used as given (call `key()` for the architecture prefix)."""
        names = [name, *aliases]
        field = next((f for f in map(self._reader.get_field, names) if f is not None), None)
        if field is None:
            if default is _MISSING:
                also = f" (or {', '.join(names[1:])})" if len(names) > 1 else ""
                raise Ds4Error(f"{self.name}: missing required metadata key {name}{also}")
            return default
        is_array = kind.endswith("s") and kind != "bool"
        accepted, what = _KINDS[kind[:-1] if is_array else kind]
        types = field.types
        ok = (len(types) == 2 and types[0] == GGUFValueType.ARRAY and types[1] in accepted) \
            if is_array else (len(types) == 1 and types[0] in accepted)
        if is_array and len(types) == 1 and types[0] == GGUFValueType.ARRAY:
            ok = True  # an empty array carries no element type
        if not ok:
            expected = f"an array of {what[3:] if what.startswith('an ') else what[2:]}s" \
                if is_array else what
            raise Ds4Error(f"{self.name}: metadata key {field.name} has type {_describe(field)}, "
                           f"expected {expected}")
        value = field.contents()
        if kind in ("bool", "bools"):
            return self._bools(field, value)
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
        if kind == "ints":
            return [int(v) for v in value]
        if kind == "floats":
            return [float(v) for v in value]
        return value

    def _bools(self, field: ReaderField, value):
        values = value if isinstance(value, list) else [value]
        bad = [int(v) for v in values if int(v) not in (0, 1)]
        if bad:
            raise Ds4Error(f"{self.name}: metadata key {field.name} holds {bad[0]}, expected booleans (or 0/1)")
        out = [bool(v) for v in values]
        return out if isinstance(value, list) else out[0]

    # ------------------------------------------------------------------ tensors
    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise Ds4Error(f"{self.name}: missing tensor {name}") from None

    def n_params(self) -> int:
        return sum(t.n_elements for t in self.tensors.values())

    def type_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t.type_name] = counts.get(t.type_name, 0) + 1
        return dict(sorted(counts.items()))


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    return GGUFFile(path)
