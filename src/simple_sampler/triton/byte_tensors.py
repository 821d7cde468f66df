"""The llm model's BYTES tensors (its ``text_output`` per response), built
without the Python backend's general serializer: one element, one length
prefix (``one_element_byte_serializer``, installed in a model's stub by
``install_byte_serializer``)."""
from __future__ import annotations

import struct
from typing import Callable

#: The 4-byte little-endian length that precedes each element of a
#: serialized BYTES tensor (Triton's wire format for strings).
_BYTE_LENGTH = struct.Struct("<I").pack


def one_element_byte_serializer(serialize: Callable) -> Callable:
    """``serialize`` (python_backend's
    ``triton_python_backend_utils.serialize_byte_tensor``) with a short path
    for a tensor of one str or bytes element, the llm model's
    ``text_output`` per response: the same bytes, without the general loop
    (``np.nditer``, ``.item()`` twice, a list, a join: eight Python calls
    per response). Anything else goes to ``serialize`` itself.

    Why a replacement: the Python backend's stub builds every BYTES
    ``pb_utils.Tensor`` by calling that module function, looked up by name at
    each construction (python_backend src/pb_tensor.cc, ``PbTensor::PbTensor``
    from a numpy array: ``py::module::import("triton_python_backend_utils")
    .attr("serialize_byte_tensor")``), and offers no other way in: ``Tensor``
    is built only from numpy (``PbTensor::FromNumpy``) or DLPack, which has
    no string type (src/pb_utils.cc, ``triton_to_dlpack_type`` refuses
    BYTES). ``install_byte_serializer`` puts it in that module's place."""
    def serialize_byte_tensor(array):
        if array.size == 1 and array.dtype == object:
            value = array.item()
            if type(value) is str:  # as serialize does: str(value).encode("utf-8")
                value = value.encode()
            if type(value) is bytes:
                return _BYTE_LENGTH(len(value)) + value
        return serialize(array)

    serialize_byte_tensor.general = serialize
    return serialize_byte_tensor


def install_byte_serializer(pb_utils) -> None:
    """In this process (a model's stub), every BYTES tensor built through
    ``one_element_byte_serializer`` (once: a second call changes nothing)."""
    if not hasattr(pb_utils.serialize_byte_tensor, "general"):
        pb_utils.serialize_byte_tensor = one_element_byte_serializer(
            pb_utils.serialize_byte_tensor)
