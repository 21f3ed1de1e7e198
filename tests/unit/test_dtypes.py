"""format/dtypes.py: the two spellings of a dtype the format writes, and reading either."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

import checkpointd
from checkpointd import tunables
from checkpointd.errors import CorruptCheckpointError
from checkpointd.format.codec import DTypeNode, decode_tree, encode_tree
from checkpointd.format.dtypes import CODES, decode_dtype, encode_dtype
from checkpointd.format.header import TensorEntry, encode_safetensors_header
from checkpointd.format.header import parse_safetensors_header as parse_header
from checkpointd.format.manifest import decode_manifest, encode_manifest, step_dirname

TORCH_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


def test_codes_are_the_safetensors_spelling_and_distinct() -> None:
    assert len(set(CODES.values())) == len(CODES)
    assert encode_dtype(torch.float32, "code") == "F32"
    assert encode_dtype(torch.bfloat16, "code") == "BF16"
    assert {torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.bool} <= CODES.keys()


@pytest.mark.parametrize("dtype", list(CODES), ids=str)
def test_a_storable_dtype_reads_back_from_either_spelling(dtype: torch.dtype) -> None:
    assert decode_dtype(encode_dtype(dtype, "code")) is dtype
    assert decode_dtype(encode_dtype(dtype, "name")) is dtype


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_every_torch_dtype_reads_back_from_its_name_in_a_tree(dtype: torch.dtype) -> None:
    # Tree values may be any dtype, quantized and sub-byte ones included.
    assert encode_dtype(dtype, "name") == str(dtype).removeprefix("torch.")
    assert decode_dtype(encode_dtype(dtype, "name"), storable=False) is dtype


@pytest.mark.parametrize("text", ["complex128", "qint8", "float8_e8m0fnu"])
def test_a_dtype_no_tensor_file_holds_is_not_read_as_tensor_data(text: str) -> None:
    assert decode_dtype(text, storable=False) is not None
    assert decode_dtype(text) is None


@pytest.mark.parametrize("text", ["", "f32", "FLOAT32", "torch.float32", "Tensor", "dtype"])
def test_text_that_spells_no_dtype_is_none(text: str) -> None:
    assert decode_dtype(text) is None
    assert decode_dtype(text, storable=False) is None


def test_a_tensor_header_reads_either_spelling() -> None:
    entries = [TensorEntry("a", torch.float32, (2,), 0, 8)]
    encoded = encode_safetensors_header(entries, align=8)
    assert b'"F32"' in encoded
    for spelled in (encoded, encoded.replace(b'"F32"', b'"float32"')):
        assert parse_header(spelled[8:], 8, where="t") == entries


def test_a_tree_dtype_value_reads_either_spelling() -> None:
    for text in ("float32", "F32"):
        assert decode_tree(encode_tree([DTypeNode(text)]), {}, where="t") == [torch.float32]
    with pytest.raises(CorruptCheckpointError, match="unknown dtype 'F33'"):
        decode_tree(encode_tree([DTypeNode("F33")]), {}, where="t")


def test_blob_refs_read_either_spelling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An incremental save's blob refs are written as codes; the same checkpoint with
    them spelled as torch names loads the same state, and a bad one is damage."""
    monkeypatch.setattr(tunables, "INCREMENTAL_MIN_BYTES", 1024)
    root = tmp_path / "ckpt"
    state = {"m": {"w": torch.arange(1024, dtype=torch.float32), "h": torch.ones(600).half()}}
    with checkpointd.CheckpointWriter(str(root), incremental=True) as writer:
        for step in (1, 2):
            writer.save(step, state).result(timeout=60)
    path = root / step_dirname(2) / "manifest.json"
    manifest = decode_manifest(path.read_bytes())
    entry = manifest.components["m"]
    assert {ref.dtype for ref in entry.refs.values()} == {"F32", "F16"}

    def write_refs(spell: dict[str, str]) -> None:
        refs = {k: msgspec.structs.replace(r, dtype=spell[r.dtype]) for k, r in entry.refs.items()}
        component = msgspec.structs.replace(entry, refs=refs)
        path.write_bytes(
            encode_manifest(msgspec.structs.replace(manifest, components={"m": component}))
        )

    write_refs({"F32": "float32", "F16": "float16"})
    loaded = checkpointd.load(str(root), step=2).state["m"]
    assert loaded.keys() == state["m"].keys()
    for name, tensor in state["m"].items():
        assert loaded[name].dtype == tensor.dtype
        assert torch.equal(loaded[name], tensor)
    write_refs({"F32": "complex128", "F16": "float16"})  # a torch name, but not storable
    with pytest.raises(CorruptCheckpointError, match="bad dtype or shape"):
        checkpointd.load(str(root), step=2)
