"""A minimal GGUF parser: metadata and zero-copy tensor views.

Why not gguf.GGUFReader: it builds a numpy memmap view per array element, so a 49k-token vocabulary takes
~3-6 s to parse. Here string arrays are decoded with struct in one pass (~50 ms) and tensors are plain slices of
one memmap. Dequantisation is still done by the `gguf` package.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# value type id -> (struct format, numpy dtype) for fixed-size scalars
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
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    """One tensor: its name, numpy-order shape, ggml type and raw bytes (a view into the file)."""

    name: str
    shape: tuple[int, ...]  # numpy order (outermost first), i.e. reversed ggml dims
    qtype: GGMLQuantizationType
    raw: np.ndarray  # uint8, flat


class GGUFFile:
    """Parsed GGUF file: `metadata` (key -> python value; arrays as lists or numpy arrays) and `tensors`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._buf = np.memmap(path, dtype=np.uint8, mode="r")
        self._mv = self._buf.data  # the memmap's buffer (numpy's stubs declare ndarray a Buffer only on 3.12+)
        self._pos = 0
        if bytes(self._mv[:4]) != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        self._pos = 4
        version = self._scalar(4)
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        tensor_count = self._scalar(10)
        kv_count = self._scalar(10)
        self.metadata: dict[str, object] = {}
        for _ in range(kv_count):
            key = self._string()
            vtype = self._scalar(4)
            self.metadata[key] = self._value(vtype)
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            n_dims = self._scalar(4)
            dims = [self._scalar(10) for _ in range(n_dims)]
            qtype = GGMLQuantizationType(self._scalar(4))
            offset = self._scalar(10)
            infos.append((name, dims, qtype, offset))
        alignment_value = self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment_value, (int, float)):
            raise ValueError(f"{path}: general.alignment is {alignment_value!r}, not a number")
        alignment = int(alignment_value)
        data_start = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensor] = {}
        for name, dims, qtype, offset in infos:
            n_elements = int(np.prod(dims)) if dims else 1
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            n_bytes = n_elements // block_size * type_size
            start = data_start + offset
            raw = self._buf[start : start + n_bytes]
            self.tensors[name] = GGUFTensor(name, tuple(reversed(dims)), qtype, raw)

    # -- low-level readers -------------------------------------------------------------------------------
    def _scalar(self, vtype: int):
        fmt, _ = _SCALARS[vtype]
        (value,) = struct.unpack_from(fmt, self._mv, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._mv, self._pos)
        start = self._pos + 8
        self._pos = start + n
        return bytes(self._mv[start : self._pos]).decode("utf-8", errors="replace")

    def _value(self, vtype: int):
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            item_type = self._scalar(4)
            n = self._scalar(10)
            if item_type in _SCALARS:
                dtype = np.dtype(_SCALARS[item_type][1]).newbyteorder("<")
                arr = np.frombuffer(self._mv, dtype=dtype, count=n, offset=self._pos)
                self._pos += n * dtype.itemsize
                return arr
            return [self._value(item_type) for _ in range(n)]
        return self._scalar(vtype)
