"""A component's tensors as the tree decoder asks for them (the reader's lazy mapping):
its tensor files read whole on first use, shared blobs by reference, sharded tensors one
box at a time, placed like the restore's DTensor templates. Reading thread."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from checkpointd.errors import CorruptCheckpointError
from checkpointd.format.manifest import ComponentEntry, ShardedTensor

if TYPE_CHECKING:
    import torch

    from checkpointd.read.indexes import ShardIndexes
    from checkpointd.state.shards import Box

__all__ = ["ComponentTensors", "Take", "TensorSource"]


class TensorSource(Protocol):
    """What ComponentTensors reads through: the reader of the step (reader.StepReader),
    which makes the mapping, so this module does not import it back."""

    @property
    def where(self) -> str: ...

    def tensors(self, name: str) -> dict[str, torch.Tensor]: ...

    def blob_tensor(self, blob: str, code: str, shape: list[int], tensor: str) -> torch.Tensor: ...

    def region(self, name: str, sharded: ShardedTensor, box: Box) -> torch.Tensor: ...

    @property
    def indexes(self) -> ShardIndexes: ...


Take = Callable[[str, Any, ShardedTensor], "torch.Tensor | None"]
"""(tensor name, its live DTensor template, the stored sharded tensor) -> the tensor to
hand the decoder instead of reading this rank's part into fresh memory, or None."""


class ComponentTensors(Mapping[str, "torch.Tensor"]):
    """A component's tensors by name, read when the tree decoder asks for them: the
    plain tensor files all at once on first use, sharded tensors one by one. ``take``:
    asked first for each sharded tensor with a template (restore's DTensor path).
    A sharded tensor's shards come through the reader's shard indexes (schema 4: most
    are in index files; read/indexes.py), those this read's box needs."""

    def __init__(
        self,
        reader: TensorSource,
        entry: ComponentEntry,
        templates: Mapping[str, Any],
        preloaded: Mapping[str, Mapping[str, torch.Tensor]],
        take: Take | None = None,
    ):
        self.reader = reader
        self.entry = entry
        self.templates = templates
        self.preloaded = preloaded
        self.take = take
        self._plain: dict[str, torch.Tensor] | None = None

    def plain(self) -> dict[str, torch.Tensor]:
        """The tensors of the component's tensor files and shared blobs, read on first use."""
        if self._plain is None:
            plain: dict[str, torch.Tensor] = {}
            for tensor_file in self.entry.tensors:
                done = self.preloaded.get(tensor_file)
                plain.update(self.reader.tensors(tensor_file) if done is None else done)
            for tensor, ref in self.entry.refs.items():
                if tensor in plain:
                    raise CorruptCheckpointError(
                        f"{self.reader.where}: tensor {tensor!r} is both in a file and a blob"
                    )
                plain[tensor] = self.reader.blob_tensor(ref.blob, ref.dtype, ref.shape, tensor)
            self._plain = plain
        return self._plain

    def __getitem__(self, name: str) -> torch.Tensor:
        from checkpointd.state.shards import as_template, holders, local_box

        sharded = self.entry.sharded.get(name)
        template = self.templates.get(name)
        if sharded is not None:  # with its shards from the indexes, those this read needs
            box = None if template is None else local_box(template)
            near = () if template is None else holders(template)
            component = self.reader.indexes.component_of(self.entry)
            sharded = self.reader.indexes.sharded(component, name, sharded, box, near)
        if template is None:
            if sharded is None:
                return self.plain()[name]
            return self.reader.region(
                name, sharded, ((0,) * len(sharded.shape), tuple(sharded.shape))
            )
        if sharded is not None and self.take is not None:
            taken = self.take(name, template, sharded)
            if taken is not None:
                return taken
        plain = None if sharded is not None else self.plain()[name]
        placed: torch.Tensor = as_template(name, template, plain, sharded, self.reader.region)
        return placed

    def __contains__(self, name: object) -> bool:
        return name in self.entry.sharded or name in self.plain()

    def __iter__(self) -> Iterator[str]:
        return iter({**self.plain(), **self.entry.sharded})

    def __len__(self) -> int:
        return len({**self.plain(), **self.entry.sharded})
