"""Tensor data of the Open Inference Protocol (KServe v2): data types, shapes and raw bytes.

Raw bytes are little-endian, unpadded; a ``BYTES`` element is a u32 little-endian length and
the bytes; ``BOOL`` one byte (non-zero true); ``BF16`` the upper 16 bits of a float32. Plain
Python (``struct``); errors are raised as the given
:class:`~inference_service.errors.InferenceError` class. See docs/open-inference-protocol.md.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from inference_service.errors import InferenceError


@dataclass(frozen=True)
class DataType:
    """How one protocol data type is stored: ``fmt`` the ``struct`` character (``""`` for BYTES),
    ``field`` the ``InferTensorContents`` field (``""``: raw only, FP16 and BF16), ``low``/``high``
    the inclusive range of integer kinds."""

    name: str
    fmt: str
    field: str
    kind: str
    low: int = 0
    high: int = 0

    @property
    def itemsize(self) -> int:
        """Bytes per element in raw form (0 for BYTES: variable)."""
        return 2 if self.name == "BF16" else struct.calcsize("<" + self.fmt) if self.fmt else 0


def _int(name: str, fmt: str, field: str, signed: bool) -> DataType:
    bits = struct.calcsize(fmt) * 8
    low, high = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    return DataType(name, fmt, field, "int", low, high)


DATATYPES: dict[str, DataType] = {t.name: t for t in (
    DataType("BOOL", "?", "bool_contents", "bool"),
    _int("UINT8", "B", "uint_contents", signed=False),
    _int("UINT16", "H", "uint_contents", signed=False),
    _int("UINT32", "I", "uint_contents", signed=False),
    _int("UINT64", "Q", "uint64_contents", signed=False),
    _int("INT8", "b", "int_contents", signed=True),
    _int("INT16", "h", "int_contents", signed=True),
    _int("INT32", "i", "int_contents", signed=True),
    _int("INT64", "q", "int64_contents", signed=True),
    DataType("FP16", "e", "", "float"),
    DataType("FP32", "f", "fp32_contents", "float"),
    DataType("FP64", "d", "fp64_contents", "float"),
    DataType("BF16", "H", "", "float"),
    DataType("BYTES", "", "bytes_contents", "bytes"),
)}
"""Every data type of the protocol, by name."""


def datatype(name: str, error: type[InferenceError], what: str) -> DataType:
    """The :class:`DataType` called ``name``; ``error`` (naming ``what`` and the known names) if unknown."""
    found = DATATYPES.get(name)
    if found is None:
        raise error(f"{what} has unknown datatype {name!r} (one of {', '.join(DATATYPES)})")
    return found


def element_count(shape: Iterable[Any], error: type[InferenceError], what: str = "tensor") -> int:
    """The number of elements of ``shape`` (1 for ``[]``); ``error`` for a dimension that is not a
    non-negative integer (the protocol's ``-1`` appears only in model metadata)."""
    count = 1
    for dim in shape:
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
            raise error(f"{what} has an invalid shape {list(shape)}: dimensions must be integers >= 0")
        count *= dim
    return count


def flatten(data: Any) -> list[Any]:
    """The elements of ``data`` in row-major order: nested lists are unrolled, a scalar is one element."""
    if not isinstance(data, list):
        return [data]
    if not any(isinstance(item, list) for item in data):
        return data
    out: list[Any] = []
    stack: list[Any] = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()
    return out


def check_values(dtype: DataType, values: list[Any], error: type[InferenceError], what: str) -> list[Any]:
    """Check and normalise JSON-typed elements against ``dtype`` (integers become floats for float
    types; BYTES keeps ``str`` or ``bytes``); ``error`` names ``what`` and the element's index."""
    kind = dtype.kind
    for index, value in enumerate(values):
        if kind == "float":
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise error(f"{what}: element {index} ({value!r}) is not a number ({dtype.name})")
        elif kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise error(f"{what}: element {index} ({value!r}) is not an integer ({dtype.name})")
            if not dtype.low <= value <= dtype.high:
                raise error(f"{what}: element {index} ({value}) is out of range for {dtype.name}")
        elif kind == "bool":
            if not isinstance(value, bool):
                raise error(f"{what}: element {index} ({value!r}) is not a boolean (BOOL)")
        elif not isinstance(value, str | bytes):
            raise error(f"{what}: element {index} ({value!r}) is not a string (BYTES)")
    if kind == "float":
        return [float(v) for v in values]
    return values


def check_count(count: int, expected: int, error: type[InferenceError], what: str, shape: list[int]) -> None:
    """Raise ``error`` unless ``count`` elements fill ``shape`` (``expected`` elements)."""
    if count != expected:
        raise error(f"{what}: shape {shape} holds {expected} elements, got {count}")


def decode_raw(dtype: DataType, raw: bytes, count: int, what: str, error: type[InferenceError]) -> list[Any]:
    """The ``count`` elements of raw tensor bytes, as floats, ints, bools or ``bytes``; ``error`` when
    ``raw`` does not hold exactly ``count``."""
    if dtype.name == "BYTES":
        return _decode_bytes(raw, count, what, error)
    size = dtype.itemsize
    if len(raw) != count * size:
        raise error(f"{what}: {len(raw)} raw bytes do not hold {count} {dtype.name} elements "
                    f"({count * size} bytes expected)")
    if dtype.name == "BF16":
        halves = struct.unpack(f"<{count}H", raw)
        return list(struct.unpack(f"<{count}f", struct.pack(f"<{count}I", *(h << 16 for h in halves))))
    if dtype.name == "BOOL":
        return [b != 0 for b in raw]
    return list(struct.unpack(f"<{count}{dtype.fmt}", raw))


class RawElements:
    """Fixed-size elements kept as raw bytes and decoded slice by slice when written out, so a request
    holds its raw size, not Python numbers (eight times more for FP32). ``len()`` is the element
    count; ``elements[start:stop]`` decodes that slice."""

    def __init__(self, dtype: DataType, raw: bytes, count: int) -> None:
        self.dtype = dtype
        self.raw = raw
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: slice) -> list[Any]:
        start, stop, step = index.indices(self.count)
        if step != 1:
            raise ValueError("RawElements slices take step 1")
        size = self.dtype.itemsize
        return decode_raw(self.dtype, self.raw[start * size:max(start, stop) * size], max(0, stop - start), "",
                          InferenceError)

    def __iter__(self) -> Iterator[Any]:
        return iter(self[:])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RawElements):
            return self.dtype == other.dtype and self.raw == other.raw
        return isinstance(other, list) and self[:] == other

    __hash__ = None  # type: ignore[assignment]


class RawBytesElements(RawElements):
    """BYTES elements kept raw (a small one costs about 40 bytes as a Python ``bytes``), decoded slice
    by slice; slices are cheapest in order (a cursor remembers the last end)."""

    def __init__(self, raw: bytes, count: int) -> None:
        super().__init__(DATATYPES["BYTES"], raw, count)
        self._cursor = (0, 0)  # (element index, byte offset) where the last slice ended

    def __getitem__(self, index: slice) -> list[Any]:
        start, stop, step = index.indices(self.count)
        if step != 1:
            raise ValueError("RawElements slices take step 1")
        element, offset = self._cursor if self._cursor[0] <= start else (0, 0)
        raw, out = self.raw, []
        while element < stop:
            (length,) = struct.unpack_from("<I", raw, offset)
            if element >= start:
                out.append(raw[offset + 4:offset + 4 + length])
            offset += 4 + length
            element += 1
        self._cursor = (element, offset)
        return out

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RawElements):
            return self.raw == other.raw and self.count == other.count
        return isinstance(other, list) and self[:] == other

    __hash__ = None  # type: ignore[assignment]


def raw_elements(dtype: DataType, raw: bytes, count: int, what: str, error: type[InferenceError]) -> RawElements:
    """A :class:`RawElements` (BYTES: :class:`RawBytesElements`, lengths checked) view of ``count``
    elements; ``error`` when ``raw`` does not hold exactly that many."""
    if dtype.name == "BYTES":
        _check_bytes(raw, count, what, error)
        return RawBytesElements(raw, count)
    if len(raw) != count * dtype.itemsize:
        raise error(f"{what}: {len(raw)} raw bytes do not hold {count} {dtype.name} elements "
                    f"({count * dtype.itemsize} bytes expected)")
    return RawElements(dtype, raw, count)


def _check_bytes(raw: bytes, count: int, what: str, error: type[InferenceError]) -> None:
    """Raise ``error`` unless ``raw`` holds exactly ``count`` length-prefixed BYTES elements."""
    offset = elements = 0
    size = len(raw)
    while offset < size:
        if offset + 4 > size:
            raise error(f"{what}: raw BYTES data ends inside an element's 4-byte length")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > size:
            raise error(f"{what}: raw BYTES element {elements} claims {length} bytes, {size - offset} remain")
        offset += length
        elements += 1
    if elements != count:
        raise error(f"{what}: raw BYTES data holds {elements} elements, the shape {count}")


def _decode_bytes(raw: bytes, count: int, what: str, error: type[InferenceError]) -> list[Any]:
    out: list[bytes] = []
    view = memoryview(raw)
    offset = 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise error(f"{what}: raw BYTES data ends inside an element's 4-byte length")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise error(f"{what}: raw BYTES element {len(out)} claims {length} bytes, "
                        f"{len(raw) - offset} remain")
        out.append(bytes(view[offset:offset + length]))
        offset += length
    if len(out) != count:
        raise error(f"{what}: raw BYTES data holds {len(out)} elements, the shape {count}")
    return out


#: Elements packed by one ``struct.pack`` call in :func:`encode_raw`.
PACK_SLICE = 65536


def encode_raw(dtype: DataType, values: list[Any] | RawElements, what: str, error: type[InferenceError]) -> bytes:
    """Raw tensor bytes of checked ``values`` (BYTES: ``bytes`` or UTF-8 ``str``); ``error`` for a value
    the type cannot hold (e.g. beyond FP16's range)."""
    n = len(values)
    try:
        if dtype.name == "BYTES":
            parts = []
            for value in values:
                data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
                parts.append(struct.pack("<I", len(data)))
                parts.append(data)
            return b"".join(parts)
        if isinstance(values, RawElements) and values.dtype == dtype:
            return values.raw
        chunks = []
        for start in range(0, n, PACK_SLICE):  # one struct call per slice: the interpreter is let go between
            chunk = values[start:start + PACK_SLICE]
            size = len(chunk)
            if dtype.name == "BF16":
                words = struct.unpack(f"<{size}I", struct.pack(f"<{size}f", *chunk))
                chunks.append(struct.pack(f"<{size}H", *(_bf16(w) for w in words)))
            else:
                chunks.append(struct.pack(f"<{size}{dtype.fmt}", *chunk))
        return b"".join(chunks)
    except (struct.error, OverflowError) as exc:
        raise error(f"{what}: values do not fit {dtype.name}: {exc}") from exc


def _bf16(word: int) -> int:
    """The BF16 half of a float32 bit pattern, rounded to nearest even (NaN stays NaN)."""
    if (word & 0x7F800000) == 0x7F800000 and word & 0x007FFFFF:
        return (word >> 16) | 0x0040
    return ((word + 0x7FFF + ((word >> 16) & 1)) >> 16) & 0xFFFF

