"""The GGUF container read in one pass: metadata values, and each tensor as a view of the file's
memory map.

PyPI's `gguf` reader (GGUFReader) builds a NumPy view for every part of every metadata value: a
49K-token vocabulary and its merges are ~250K views, 2.1 s of a SmolLM2 server's start, paid in
both of its processes (a Llama-3 vocabulary is three times the size). This reads the same
little-endian files (versions 2 and 3) with `struct` and one NumPy view per numeric array, in
~0.1 s, and keeps `gguf` for what it does well: the tensor types, their block sizes and the
dequantizers (engine/gguf.py). tests/engine/test_gguf_reader.py holds it to GGUFReader's values.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS

# GGUF metadata value types (gguf.GGUFValueType): scalars as struct formats and NumPy dtypes
_SCALARS = {
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
# Unquantized tensor types (gguf.GGMLQuantizationType values) that the file holds as plain items;
# every other type is a byte stream of blocks.
_PLAIN = {
    0: np.float32,
    1: np.float16,
    24: np.int8,
    25: np.int16,
    26: np.int32,
    27: np.int64,
    28: np.float64,
}


class GGUFFormatError(ValueError):
    """Not a GGUF file this reader understands; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor as gguf.GGUFReader gives it: `shape` innermost first (as GGUF lists it), and
    `data` the file's bytes viewed as its items (float32, float16, ...) or, for a quantized type,
    as uint8 rows of blocks."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFFile:
    """An opened GGUF file: `fields` (metadata values by key: int, float, bool, str, or lists of
    them) and `tensors` (in file order). The memory map stays open while any tensor view lives."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = memoryview(self._map)
        self._pos = 0
        try:
            self._parse()
        except struct.error:  # a number read past the end
            raise GGUFFormatError("the file ends inside its header: truncated") from None

    def _parse(self) -> None:
        if bytes(self._buf[:4]) != MAGIC:
            raise GGUFFormatError("GGUF magic invalid")
        self._pos = 4
        (version,) = self._unpack("<I")
        if version not in VERSIONS:
            if version & 0xFFFF == 0:
                raise GGUFFormatError("a big-endian GGUF file; convert it on a little-endian host")
            raise GGUFFormatError(f"GGUF version {version}; versions 2 and 3 are supported")
        tensor_count, kv_count = self._unpack("<QQ")
        self.fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            if key in self.fields:
                raise GGUFFormatError(f"duplicate metadata key {key}")
            (kind,) = self._unpack("<I")
            if key == "general.alignment" and kind != _UINT32:
                raise GGUFFormatError("general.alignment is not a uint32")
            self.fields[key] = self._value(kind)
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"alignment {alignment} is not a power of two")
        start = -(-self._pos // alignment) * alignment
        self.tensors = self._tensors(infos, start)

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        end = self._pos + n
        if end > len(self._buf):
            raise GGUFFormatError("a string runs past the end of the file: truncated")
        s = str(self._buf[self._pos : end], "utf-8")
        self._pos = end
        return s

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind][0])[0]
        if kind != _ARRAY:
            raise GGUFFormatError(f"unknown metadata value type {kind}")
        item, n = self._unpack("<IQ")
        if item == _STRING:
            return [self._string() for _ in range(n)]
        if item not in _SCALARS:  # arrays of arrays: no converter writes them
            raise GGUFFormatError(f"metadata arrays of type {item} are not supported")
        dtype = np.dtype(_SCALARS[item][1]).newbyteorder("<")
        end = self._pos + n * dtype.itemsize
        if end > len(self._buf):
            raise GGUFFormatError("an array runs past the end of the file: truncated")
        values = np.frombuffer(self._buf[self._pos : end], dtype=dtype).tolist()
        self._pos = end
        return values

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        (n_dims,) = self._unpack("<I")
        if n_dims > MAX_DIMS:  # a garbled count would have struct build a format that long
            raise GGUFFormatError(f"tensor {name} has {n_dims} dimensions; GGML's have at most 4")
        dims = self._unpack(f"<{n_dims}Q")
        kind, offset = self._unpack("<IQ")
        return name, dims, kind, offset

    def _tensors(
        self, infos: list[tuple[str, tuple[int, ...], int, int]], start: int
    ) -> list[GGUFTensor]:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        whole = np.frombuffer(self._map, dtype=np.uint8)
        tensors: list[GGUFTensor] = []
        names: set[str] = set()
        for name, dims, kind, offset in infos:
            if name in names:
                raise GGUFFormatError(f"duplicate tensor {name}")
            names.add(name)
            try:
                ggml_type = GGMLQuantizationType(kind)
            except ValueError:
                raise GGUFFormatError(f"tensor {name}: unknown type {kind}") from None
            shape = tuple(reversed(dims))  # torch's order, outermost first
            n = int(np.prod(dims, dtype=np.int64))
            block, size = GGML_QUANT_SIZES[ggml_type]
            nbytes = n * size // block
            begin = start + offset
            if begin + nbytes > whole.size:
                raise GGUFFormatError(f"tensor {name} runs past the end of the file: truncated")
            raw = whole[begin : begin + nbytes]
            if kind in _PLAIN:
                data = raw.view(_PLAIN[kind]).reshape(shape)
            else:
                data = raw.reshape(quant_shape_to_byte_shape(shape, ggml_type))
            tensors.append(GGUFTensor(name, ggml_type, tuple(dims), data))
        return tensors
