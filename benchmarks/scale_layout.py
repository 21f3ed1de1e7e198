"""The scale model's job: a 70B-parameter transformer's tensors, sharded as FSDP2 or HSDP.

What each simulated rank would post after writing its share of a many-rank save,
built as ``plan.plan_shards`` and ``write.ranked_commit`` build it (the same structs, file
names and block CRC32C counts), without the bytes: a CRC32C value is a random
32-bit number, which is all the manifest's size depends on. The tensor list is
Llama-3-70B's (80 layers, hidden 8192, MLP 28672, 8 KV heads of 128, vocabulary
128256): 723 parameters in float32 (FSDP2's sharded master weights) and AdamW's
``exp_avg``/``exp_avg_sq`` per parameter, 2,169 DTensors of 70.6e9 elements in all,
plus per-rank RNG state (a ``PerRank`` component) as real training loops save.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass
from datetime import UTC, datetime

from checkpointd import tunables
from checkpointd.format.checksum import crc32c
from checkpointd.format.layout import (
    shard_file_name,
    shard_index_name,
    tensor_file_name,
    tree_file_name,
)
from checkpointd.format.manifest import ComponentEntry, FileEntry, ShardedTensor, ShardEntry
from checkpointd.format.shard_index import ShardIndex, encode_index
from checkpointd.ranks.group import rank_key
from checkpointd.write.items import PlannedFile, RankFile, WriteFile, assign_ranks
from checkpointd.write.plan import SavePlan
from checkpointd.write.ranked_merge import Share, indexed_share, written_shards

TOKEN = "3f9a1c2e"
HIDDEN, MLP, KV, VOCAB, LAYERS = 8192, 28672, 1024, 128256, 80
FLOAT32 = 4


def model_tensors() -> list[tuple[str, tuple[int, ...]]]:
    """Llama-3-70B's parameters (name, global shape), in ``named_parameters`` order."""
    tensors: list[tuple[str, tuple[int, ...]]] = [("embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(LAYERS):
        p = f"layers.{i}."
        tensors += [
            (p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
            (p + "self_attn.k_proj.weight", (KV, HIDDEN)),
            (p + "self_attn.v_proj.weight", (KV, HIDDEN)),
            (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
            (p + "mlp.gate_proj.weight", (MLP, HIDDEN)),
            (p + "mlp.up_proj.weight", (MLP, HIDDEN)),
            (p + "mlp.down_proj.weight", (HIDDEN, MLP)),
            (p + "input_layernorm.weight", (HIDDEN,)),
            (p + "post_attention_layernorm.weight", (HIDDEN,)),
        ]
    return [*tensors, ("norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]


@functools.cache
def components() -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """The job's sharded components: the model, and its optimizer's state by parameter
    name (as ``get_optimizer_state_dict`` gives it)."""
    params = model_tensors()
    optim = [(f"state.{n}.{k}", s) for n, s in params for k in ("exp_avg", "exp_avg_sq")]
    return {"model": params, "optim": optim}


@dataclass(frozen=True)
class Mesh:
    """An HSDP mesh (``replicas`` x ``shards``, placements ``(Replicate(), Shard(0))``);
    FSDP2 is ``replicas`` 1. Rank ``r`` sits at (r // shards, r % shards)."""

    replicas: int
    shards: int

    @property
    def world(self) -> int:
        return self.replicas * self.shards

    @property
    def name(self) -> str:
        return "fsdp" if self.replicas == 1 else f"hsdp{self.replicas}x{self.shards}"


def mesh_for(layout: str, world: int, shard_group: int) -> Mesh:
    """``fsdp``: every rank holds a shard; ``hsdp``: shards over ``shard_group`` ranks,
    replicated over the rest."""
    if layout == "fsdp" or world <= shard_group:
        return Mesh(1, world)
    return Mesh(world // shard_group, shard_group)


def chunk(rows: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, rows) of chunk ``index`` of ``rows`` split in ``parts`` as DTensor's
    Shard(0) splits them (torch.chunk: ceil-sized pieces, the tail ones empty)."""
    size = math.ceil(rows / parts)
    start = min(size * index, rows)
    return start, min(start + size, rows) - start


def shard_count(mesh: Mesh) -> int:
    """The shard entries the save stores (every non-empty chunk of every tensor, each
    written once): ``chunk``'s pieces counted by rule."""
    count = 0
    for tensors in components().values():
        for _, shape in tensors:
            size = math.ceil(shape[0] / mesh.shards)
            count += math.ceil(shape[0] / size) if size else 0
    return count


def _share_of_component(
    name: str,
    tensors: list[tuple[str, tuple[int, ...]]],
    mesh: Mesh,
    rank: int,
    rng: random.Random,
    *,
    everything: bool,
) -> tuple[dict[str, ShardedTensor], FileEntry | None]:
    """The sharded tensors rank ``rank`` writes of component ``name`` (plan_shards'
    entries) and its shard file's entry."""
    replica, index = divmod(rank, mesh.shards)
    file = shard_file_name(name, TOKEN, rank)
    entries: dict[str, ShardedTensor] = {}
    begin = 4096  # the safetensors header, DIRECT_ALIGN-padded
    for ordinal, (tensor, shape) in enumerate(tensors):
        if ordinal % mesh.replicas != replica:  # another replica writes it (local_shard)
            if everything:
                entries[tensor] = ShardedTensor("float32", list(shape), [])
            continue
        entry = ShardedTensor("float32", list(shape), [])
        entries[tensor] = entry
        offset, rows = chunk(shape[0], mesh.shards, index)
        local = [rows, *shape[1:]]
        nbytes = math.prod(local) * FLOAT32
        blocks = math.ceil(nbytes / tunables.SHARD_BLOCK_BYTES)
        crcs = [rng.getrandbits(32) for _ in range(blocks)]
        offsets = [offset] + [0] * (len(shape) - 1)
        entry.shards.append(
            ShardEntry(file, offsets, local, begin, tunables.SHARD_BLOCK_BYTES, crcs)
        )
        begin += nbytes
    if begin == 4096:
        return entries, None
    return entries, FileEntry(file, begin, rng.getrandbits(32), rank)


def share_of(rank: int, mesh: Mesh, indexed: SavePlan | None = None) -> Share:
    """What rank ``rank`` posts once its files are durable, as ``write.ranked_commit`` makes it
    of its plan (``plan_of``) and the entries of the files it wrote; ``indexed`` (a plan
    of the save, any rank's): with its shard entries in its shard index file (whose entry
    is among its files), as a job over ``tunables.SHARD_INDEX_MIN_ENTRIES`` posts it."""
    files, sharded = _rank_files(rank, mesh, everything=False)
    key = rank_key("rng", rank)
    own = {key: _rng_entry(rank)}
    entries = {name: ComponentEntry(tree="", sharded=tensors) for name, tensors in sharded.items()}
    share = Share(files, own, {key: "rng"}, written_shards(entries, {}))
    if indexed is None:
        return share
    data = index_of(rank, mesh, share)
    name = ""
    if data is not None:
        name = index_name(rank)
        files.append(FileEntry(name, len(data), crc32c(data), rank))
    return indexed_share(share, indexed, name)


def index_name(rank: int) -> str:
    """The name of rank ``rank``'s shard index in the model (attempt 0)."""
    return shard_index_name(f"{TOKEN}0", rank)


def index_of(rank: int, mesh: Mesh, share: Share | None = None) -> bytes | None:
    """The bytes of rank ``rank``'s shard index file (``write.ranked_merge.shard_index``), or
    None if it writes no shard (an HSDP replica whose shards another replica writes)."""
    if share is None:
        share = share_of(rank, mesh)
    if not share.sharded:
        return None
    components = {c: {t: s.shards for t, s in ts.items()} for c, ts in share.sharded.items()}
    return encode_index(ShardIndex(1000, rank, components))


def _rng_entry(rank: int) -> ComponentEntry:
    """The entry of rank ``rank``'s RNG state (a per-rank component)."""
    return ComponentEntry(
        tree=tree_file_name(rank_key("rng", rank), TOKEN), nbytes=5136, num_tensors=1
    )


def _rank_files(
    rank: int, mesh: Mesh, *, everything: bool
) -> tuple[list[FileEntry], dict[str, dict[str, ShardedTensor]]]:
    """The entries of the files rank ``rank`` writes (its shard files, its RNG state's
    tree, its share of the replicated files) and its plan's sharded tensors."""
    rng = random.Random(rank)
    files: list[FileEntry] = []
    sharded: dict[str, dict[str, ShardedTensor]] = {}
    for name, tensors in components().items():
        sharded[name], entry = _share_of_component(
            name, tensors, mesh, rank, rng, everything=everything
        )
        if entry is not None:
            files.append(entry)
    rng_key = rank_key("rng", rank)
    rng_tree = tree_file_name(rng_key, TOKEN)
    files.append(FileEntry(rng_tree, 5200, rng.getrandbits(32), rank))
    if rank < len(_replicated_files()):  # assign_ranks: largest first, least-loaded rank
        path, size = _replicated_files()[rank]
        files.append(FileEntry(path, size, rng.getrandbits(32), rank))
    return files, sharded


def _replicated_files() -> list[tuple[str, int]]:
    """The files of the replicated parts of the components (trees, the optimizer's
    per-parameter ``step`` counters), largest first: name and size."""
    params = len(model_tensors())
    return [
        (tree_file_name("optim", TOKEN), 220 * params),
        (tree_file_name("model", TOKEN), 90 * params),
        (tensor_file_name("optim", TOKEN), 4096 + 80 * params),
    ]


def plan_of(rank: int, mesh: Mesh) -> SavePlan:
    """Rank ``rank``'s plan of the save: its component entries with its shards, its own
    files (a few bytes each: the store and the manifest are what the model measures,
    not the disk) and the replicated files, the same bytes on every rank."""
    written, sharded = _rank_files(rank, mesh, everything=True)
    replicated = dict(_replicated_files())
    files: list[PlannedFile] = [
        RankFile(f.path, [b"\0" * 64], f.path.split(".")[0], rank)
        for f in written
        if f.path not in replicated
    ]
    files += [
        WriteFile(path, [b"\0" * size], path.split(".")[0]) for path, size in replicated.items()
    ]
    files = assign_ranks(files, mesh.world)
    params = len(model_tensors())
    rng_key = rank_key("rng", rank)
    entries = {
        "model": ComponentEntry(
            tree=tree_file_name("model", TOKEN), num_tensors=params, sharded=sharded["model"]
        ),
        "optim": ComponentEntry(
            tree=tree_file_name("optim", TOKEN),
            tensors=[tensor_file_name("optim", TOKEN)],
            nbytes=8 * params,
            num_tensors=params,
            sharded=sharded["optim"],
        ),
        rng_key: _rng_entry(rank),
    }
    return SavePlan(
        step=1000,
        files=files,
        components=entries,
        created_at=datetime(2026, 12, 1, tzinfo=UTC),
        metrics={"loss": 1.234},
        metadata={},
        per_rank={rng_key: "rng"},
    )
