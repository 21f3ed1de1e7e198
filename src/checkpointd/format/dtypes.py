"""The one home of dtype spellings: a ``torch.dtype`` as the format writes it, and back.

The format spells a dtype two ways, each fixed by what reads that field: the
safetensors code (``"F32"``) in tensor-file headers (the safetensors spec, which
other tools read) and in blob refs; torch's name (``"float32"``) in sharded tensors
and in tree values (extension 6, which may hold any torch dtype, most without a
code). Writers keep each field's spelling, so the format does not change;
``decode_dtype`` reads either spelling in any field. docs/format.md is the spec.
"""

from __future__ import annotations

from typing import Literal

import torch

from checkpointd.errors import UnsupportedValueError

__all__ = ["CODES", "Spelling", "check_storable", "decode_dtype", "encode_dtype"]

Spelling = Literal["code", "name"]

# The dtypes a tensor file holds, with their safetensors codes; this order is the
# order of preference on write.
CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.complex64: "C64",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
_BY_CODE = {code: dtype for dtype, code in CODES.items()}
# torch's namespace read directly: getattr(torch, name) may import submodules.
_BY_NAME = {name: v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}


def encode_dtype(dtype: torch.dtype, spelling: Spelling) -> str:
    """``dtype`` spelled as its safetensors ``"code"`` (``"F32"``; ``dtype`` must be in
    CODES, see check_storable) or its torch ``"name"`` (``"float32"``)."""
    if spelling == "code":
        return CODES[dtype]
    return str(dtype).removeprefix("torch.")


def decode_dtype(text: str, *, storable: bool = True) -> torch.dtype | None:
    """The dtype ``text`` spells, as a safetensors code or a torch name; None if it
    spells none or, with ``storable``, one a tensor file cannot hold (not in CODES).
    The caller raises the error its field calls for."""
    dtype = _BY_CODE.get(text, _BY_NAME.get(text))
    if dtype is None or (storable and dtype not in CODES):
        return None
    return dtype


def check_storable(dtype: torch.dtype, path: str) -> None:
    """Raise UnsupportedValueError if tensors of ``dtype`` cannot be stored."""
    if dtype not in CODES:
        supported = ", ".join(encode_dtype(d, "name") for d in CODES)
        raise UnsupportedValueError(
            f"{path}: dtype {dtype} cannot be stored in a safetensors file (supported: {supported})"
        )
