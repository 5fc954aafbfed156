"""Packed little-endian bytes <-> numpy, without extra copies (np.frombuffer views the bytes)."""

from __future__ import annotations

import math

import numpy as np

from serve.errors import ValidationError
from serve.protocols.pb import pb

# proto DataType -> little-endian numpy dtype, and back: what a request may send (DTYPES), and what an answer
# may carry besides (an encoded embedding, serve/core/encodings.py: int8, uint8, binary, ubinary).
DTYPES: dict[int, np.dtype] = {
    pb.DATA_TYPE_FLOAT32: np.dtype("<f4"),
    pb.DATA_TYPE_INT64: np.dtype("<i8"),
    pb.DATA_TYPE_INT32: np.dtype("<i4"),
    pb.DATA_TYPE_BOOL: np.dtype("bool"),
}
ANSWER_DTYPES: dict[int, np.dtype] = {**DTYPES, pb.DATA_TYPE_INT8: np.dtype("i1"), pb.DATA_TYPE_UINT8: np.dtype("u1")}
_CODES = {dtype.str if dtype.kind != "b" else "|b1": code for code, dtype in ANSWER_DTYPES.items()}


def dtype_name(code: int) -> str:
    return pb.DataType.Name(code) if code in pb.DataType.values() else f"DataType({code})"


def check_shape(shape, field: str, layout: str, max_rank: int) -> tuple[int, ...]:
    """The shape as ints, once it has at most `max_rank` dimensions (the rank `layout`, e.g.
    "[B, T]", needs) and none is negative. The one rank rule of Encode and KServe v2, checked before
    numpy sees the shape: numpy refuses more than 64 dimensions with its own ValueError, and a shape
    with thousands of dimensions must not reach a message."""
    if len(shape) > max_rank:
        raise ValidationError(f"{field}.shape: {len(shape)} dimensions; {field} must be of shape {layout}")
    shape = tuple(shape)
    if min(shape, default=0) < 0:
        raise ValidationError(f"{field}.shape: negative dimension in {list(shape)}")
    return shape


def array_from_bytes(data: bytes, dtype: np.dtype, shape, *, field: str, data_field: str | None,
                     type_name: str, layout: str, max_rank: int) -> np.ndarray:
    """A read-only view of packed little-endian `data` as `shape`; ValidationError naming the field
    when the shape has more than `max_rank` dimensions or a negative one, the byte count does not
    match, or BOOL bytes are not 0 or 1 (`data_field`: how a message names the bytes; None: `field`'s
    "raw contents").
    Shared by Encode (`Tensor.data`) and KServe v2 (`raw_input_contents`)."""
    shape = check_shape(shape, field, layout, max_rank)
    expected = math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise ValidationError(
            f"{data_field or f'{field} raw contents'}: {len(data)} bytes, but shape {list(shape)} of {type_name} "
            f"needs {expected}"
        )
    array = np.frombuffer(data, dtype=dtype).reshape(shape)
    if dtype.kind == "b" and array.size and array.view(np.uint8).max() > 1:  # numpy would read 2..255 as True
        raise ValidationError(f"{data_field or f'{field} raw contents'}: BOOL elements must be bytes 0 or 1")
    return array


def to_numpy(tensor: "pb.Tensor", field: str, layout: str = "", max_rank: int = 8, *,
             answer: bool = False) -> np.ndarray:
    """A read-only view of the tensor's bytes; ValidationError naming `field` when inconsistent or
    of more than `max_rank` dimensions (`layout`: the shape the field takes, for the message). `answer`:
    a tensor of an answer (a client reading it), which may also be INT8 or UINT8."""
    dtype = (ANSWER_DTYPES if answer else DTYPES).get(tensor.dtype)
    if dtype is None:
        raise ValidationError(f"{field}.dtype: {dtype_name(tensor.dtype)} is not supported")
    return array_from_bytes(tensor.data, dtype, tensor.shape, field=field, data_field=f"{field}.data",
                            type_name=dtype_name(tensor.dtype), layout=layout or f"at most {max_rank}-d",
                            max_rank=max_rank)


def from_numpy(array: np.ndarray) -> "pb.Tensor":
    """Packs an array (converted to little-endian, C order, only when it is not already)."""
    array = np.asarray(array)
    if array.dtype.kind == "b":
        code = pb.DATA_TYPE_BOOL
        array = array.astype(bool, copy=False)
    else:
        little = array.dtype.newbyteorder("<")
        code = _CODES.get(little.str)
        if code is None:
            raise TypeError(f"cannot send dtype {array.dtype}; use float32, int64, int32, int8, uint8 or bool")
        array = array.astype(little, copy=False)
    return pb.Tensor(dtype=code, shape=array.shape, data=np.ascontiguousarray(array).tobytes())
