"""What ``checkpointd inspect`` shows, as JSON-able data: manifest, tensor headers, files.

Reads the manifest and each tensor file's header, never tensor data; a sharded
tensor (many ranks) shows its global shape and each shard's rank, offsets and
shape. Blocking; any thread.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from checkpointd.format.layout import blob_path
from checkpointd.read import catalog
from checkpointd.read.reader import StepReader
from checkpointd.storage import Store

__all__ = ["describe"]


def _dtype(text: str) -> tuple[str, int]:
    """A stored dtype (either spelling) as shown, a torch name, and its bytes per element;
    an unknown one as stored, with 0."""
    from checkpointd.format.dtypes import decode_dtype, encode_dtype

    dtype = decode_dtype(text)
    return (text, 0) if dtype is None else (encode_dtype(dtype, "name"), dtype.itemsize)


def describe(store: Store, step: int | None = None) -> dict[str, Any]:
    """The checkpoint at ``step`` (default: the newest) as plain data.

    Unlike ``load``, a newest manifest that is damaged raises here instead of being
    skipped: this is the tool that should show it.
    """
    from checkpointd.format.dtypes import encode_dtype

    found, manifest = catalog.resolve(store, step, on_damaged=catalog.raise_damaged)
    reader = StepReader(store, found, manifest)
    blobs = {b.name: b for b in manifest.blobs}
    components: dict[str, Any] = {}
    for name, entry in manifest.components.items():
        tensors: list[dict[str, Any]] = []
        for tensor_file in entry.tensors:
            tensors.extend(
                {
                    "name": e.name,
                    "dtype": encode_dtype(e.dtype, "name"),
                    "shape": list(e.shape),
                    "nbytes": e.end - e.begin,
                    "file": tensor_file,
                }
                for e in sorted(reader.header(tensor_file), key=lambda e: e.begin)
            )
        rank_of = {f.path: f.rank for f in manifest.files}
        for tensor, stored in entry.sharded.items():
            sharded = reader.indexes.sharded(name, tensor, stored)
            elements = sum(math.prod(s.shape) for s in sharded.shards)
            shown, itemsize = _dtype(sharded.dtype)
            tensors.append(
                {
                    "name": tensor,
                    "dtype": shown,
                    "shape": list(sharded.shape),
                    "nbytes": elements * itemsize,
                    "shards": [
                        {
                            "file": s.file or blob_path(s.blob),
                            "rank": None if s.blob else rank_of.get(s.file, 0),
                            "offsets": list(s.offsets),
                            "shape": list(s.shape),
                        }
                        for s in sharded.shards
                    ],
                }
            )
        tensors.extend(
            {
                "name": tensor,
                "dtype": _dtype(ref.dtype)[0],
                "shape": list(ref.shape),
                "nbytes": blobs[ref.blob].size,
                "file": blob_path(ref.blob),
                "shared": True,
            }
            for tensor, ref in entry.refs.items()
        )
        components[name] = {
            "tree": entry.tree,
            "tensor_files": list(entry.tensors),
            "nbytes": entry.nbytes + sum(t["nbytes"] for t in tensors if "shards" in t),
            "tensors": tensors,
        }
    return {
        "step": found,
        "path": reader.where,
        "created_at": manifest.created_at.isoformat(),
        "nbytes": manifest.nbytes,
        "written_nbytes": manifest.nbytes - manifest.referenced_nbytes,
        "referenced_nbytes": manifest.referenced_nbytes,
        "schema_version": manifest.schema_version,
        "library_version": manifest.library_version,
        "world_size": manifest.world_size,
        "metrics": manifest.metrics,
        "metadata": manifest.metadata,
        "specs": {name: msgspec.to_builtins(entry) for name, entry in manifest.specs.items()},
        "components": components,
        "per_rank": manifest.per_rank,
        "files": [
            {"path": f.path, "size": f.size, "crc32c": f"{f.crc32c:08x}", "rank": f.rank}
            for f in manifest.files
        ],
        "blobs": [
            {
                "path": blob_path(b.name),
                "size": b.size,
                "written": b.written,
            }
            for b in manifest.blobs
        ],
    }
