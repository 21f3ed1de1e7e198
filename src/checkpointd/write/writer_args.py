"""What a save accepts besides the state: its metrics and metadata as plain JSON that
fits in a manifest (the writer's own options are options.py). Caller thread."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
import numpy as np
import torch

from checkpointd import tunables
from checkpointd.errors import UnsupportedValueError
from checkpointd.format.manifest import too_deep

__all__ = ["plain_metrics_and_metadata"]


def _json_hook(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, np.generic):
        return value.item()
    raise UnsupportedValueError(f"{type(value).__qualname__} is not JSON-able")


def plain_metrics_and_metadata(
    step: int, metrics: Mapping[str, Any] | None, metadata: Mapping[str, Any] | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Plain-JSON copies of a save's ``metrics`` and ``metadata``; UnsupportedValueError
    unless both are JSON-able mappings that fit in a manifest together. Caller thread."""
    plain_metrics, metrics_bytes = _plain_json(metrics, "metrics")
    plain_metadata, metadata_bytes = _plain_json(metadata, "metadata")
    if metrics_bytes + metadata_bytes > tunables.MAX_METADATA_BYTES:
        raise UnsupportedValueError(
            f"metrics and metadata of step {step} encode to {metrics_bytes + metadata_bytes} "
            f"bytes; at most {tunables.MAX_METADATA_BYTES} fit in a manifest (readers refuse "
            "larger ones): put large values in the state instead"
        )
    return plain_metrics, plain_metadata


def _plain_json(value: Mapping[str, Any] | None, what: str) -> tuple[dict[str, Any], int]:
    """A plain-JSON copy of ``value`` and its encoded size: scalar tensors and NumPy
    scalars become numbers, NaN and infinities become null (JSON has neither)."""
    if value is None:
        return {}, 2
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise UnsupportedValueError(f"{what} must be a mapping with str keys")
    try:
        encoded = msgspec.json.encode(value, enc_hook=_json_hook)
        plain: dict[str, Any] = msgspec.json.decode(encoded)
    except (UnsupportedValueError, TypeError, OverflowError, msgspec.EncodeError) as exc:
        raise UnsupportedValueError(f"{what} must be JSON-able: {exc}") from exc
    except RecursionError:
        raise UnsupportedValueError(
            f"{what} nests deeper than {tunables.MAX_JSON_DEPTH} levels: readers refuse such a manifest"
        ) from None
    if too_deep(plain):
        raise UnsupportedValueError(
            f"{what} nests deeper than {tunables.MAX_JSON_DEPTH} levels: readers refuse such a manifest"
        )
    return plain, len(encoded)
