"""The service process (``checkpointd serve``): one per node and user.

One anyio event loop (asyncio). Each connection is served by a task of its own,
so a client that sends garbage, stalls inside a frame or hangs up only ends its
own connection. Its writers and their saves are saves.py's; the shared memory
they use, the memory limit and lending are memory.py's. Imports torch (saves).

Who owns what: a segment is the connection's from ``Alloc`` until ``Submit``
(or ``Free``), then the save's until it resolves, then the memory tier's (if it
committed and the tier keeps it) until evicted; a held segment lent to a
restoring client stays until that client's connection ends. ``memory_limit``
bounds the sum. An ``Alloc`` that waits for memory runs in a task of its
connection's, so the frames the client sends after it (a ``Free`` that may be
what it waits for) are still served; the connection's end cancels it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import AsyncIterator

import anyio
from anyio.abc import SocketAttribute, SocketStream

from checkpointd import errors, tunables
from checkpointd.daemon.server.admission import Admission, accept_loop, descriptor_limit
from checkpointd.daemon.server.conn import Conn
from checkpointd.daemon.server.memory import SharedMemory
from checkpointd.daemon.server.memtier import MemoryTier, root_key
from checkpointd.daemon.server.peerlink import PeerPort, peer_host
from checkpointd.daemon.server.replicas import Replicas, ref_of
from checkpointd.daemon.server.saves import Saves
from checkpointd.daemon.wire import protocol as p
from checkpointd.daemon.wire.bounds import FrameBudget
from checkpointd.daemon.wire.frames import read_async
from checkpointd.daemon.wire.paths import (
    lock_or_fail,
    peer_credentials,
    prepare_folder,
    remove_stale,
)
from checkpointd.daemon.wire.shm import huge_pages_mode, readonly_fd
from checkpointd.errors import CheckpointError

__all__ = ["Server", "serve"]

_log = logging.getLogger(__name__)


class Server:
    """The service's state, on its event loop."""

    def __init__(
        self,
        socket_path: str,
        *,
        memory_limit: int | None = None,
        keep_in_memory: int = 1,
        idle_exit: float | None = None,
        peer_address: str | None = None,
    ) -> None:
        self.socket_path = os.path.abspath(socket_path)
        self.peer_address = peer_address
        self.memory_limit = memory_limit
        self.idle_exit = idle_exit
        self.memory = SharedMemory(memory_limit)
        self.tier = MemoryTier(keep_in_memory, self.memory.release)
        self.replicas = Replicas(keep_in_memory, self.memory.release)
        # replicas go first, oldest first; then this node's own held steps
        self.memory.evict = lambda: self.replicas.evict_oldest() or self.tier.evict_oldest()
        self.saves: Saves | None = None
        self.clients = 0
        self.admission = Admission(descriptor_limit())
        self.memory.max_segments = self.admission.max_segments
        self.frames = FrameBudget(tunables.FRAME_BUFFER_BYTES)
        self.peers = PeerPort(self.memory, self.tier, self.replicas, self.admission, self.frames)
        self.tier.added = self.peers.added
        self.peers.busy = lambda: self.in_flight + self.staging
        self.conns: set[Conn] = set()
        self._quiet_since = time.monotonic()

    # -- the process ------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return 0 if self.saves is None else self.saves.in_flight

    @property
    def staging(self) -> int:
        """Segments clients hold and have not submitted yet (a save being captured)."""
        return sum(len(conn.owned) for conn in self.conns)

    async def run(self) -> None:
        """Listen until SIGTERM/SIGINT (or ``idle_exit``), then finish saves in flight."""
        folder = prepare_folder(self.socket_path)
        lock = lock_or_fail(self.socket_path)
        # SIGTERM/SIGINT are caught before the socket exists: one sent the moment a client
        # can connect finishes what was accepted instead of killing the process.
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            try:
                remove_stale(self.socket_path)
                listener = await anyio.create_unix_listener(self.socket_path, mode=0o600)
                os.chmod(folder, 0o700)
                _log.info("serving at %s (pid %d)", self.socket_path, os.getpid())
                _log.info("shared-memory huge pages: %s", huge_pages_mode())
                host = peer_host(self.peer_address)
                peer_listener = None if host is None else await self.peers.listen(host)
                _log.info("peer port: %s", self.peers.address)
                async with anyio.create_task_group() as group:
                    self.saves = saves = Saves(self.memory, self.tier, group)
                    self.memory.spares_wanted = lambda: len(saves.writers)
                    with anyio.CancelScope() as listening:
                        group.start_soon(self._watch, listening, signals)
                        async with anyio.create_task_group() as ports:
                            if peer_listener is not None:
                                ports.start_soon(self.peers.serve, peer_listener, group)
                            await accept_loop(
                                listener, self._connection, group, self.admission.refused
                            )
                    await listener.aclose()
                    if peer_listener is not None:
                        await peer_listener.aclose()
                    await self.saves.drain()
                    group.cancel_scope.cancel()
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(self.socket_path)
                self.tier.clear()
                self.replicas.clear()
                self.memory.close()
                os.close(lock)
        _log.info("stopped")

    async def _watch(self, listening: anyio.CancelScope, signals: AsyncIterator[int]) -> None:
        """End listening at SIGTERM/SIGINT (``signals``), or when idle for ``idle_exit``
        seconds."""
        async with anyio.create_task_group() as group:

            async def idle() -> None:
                while True:
                    await anyio.sleep(tunables.IDLE_CHECK_SECONDS)
                    busy = self.clients or self.in_flight
                    if busy:
                        self._quiet_since = time.monotonic()
                    elif self.idle_exit is not None and (
                        time.monotonic() - self._quiet_since >= self.idle_exit
                    ):
                        _log.info("idle for %ss: exiting", self.idle_exit)
                        break
                group.cancel_scope.cancel()

            group.start_soon(idle)
            async for signum in signals:
                _log.info("signal %d: finishing saves in flight, then exiting", signum)
                break
            group.cancel_scope.cancel()
        listening.cancel()

    async def _connection(self, stream: SocketStream) -> None:
        """Serve one connection; whatever fails in it ends it alone (logged)."""
        try:
            await self._connected(stream)
        except Exception:
            _log.exception("a connection failed; it is closed, the service goes on")
            with contextlib.suppress(Exception):
                await stream.aclose()

    async def _connected(self, stream: SocketStream) -> None:
        raw: socket.socket = stream.extra(SocketAttribute.raw_socket)
        try:
            pid, uid = peer_credentials(raw)
        except OSError:
            pid, uid = 0, -1
        conn = Conn(stream, pid)
        if uid != os.getuid():
            _log.warning("refused a connection from uid %d", uid)
            await conn.send(p.Error(0, "ServiceError", "this service serves its own user only"))
            await stream.aclose()
            return
        if (refusal := self.admission.admit(conn)) is not None:
            _log.warning("refused a connection: %s", refusal)
            await conn.send(p.Error(0, "ServiceError", refusal))
            await stream.aclose()
            return
        self.clients += 1
        self.conns.add(conn)
        try:
            async with anyio.create_task_group() as conn.tasks:
                await self._serve(conn)
                conn.tasks.cancel_scope.cancel()  # its allocations still waiting: gone too
        finally:
            conn.open = False
            for segment in list(conn.owned.values()):
                self.memory.release(segment)  # captured into but never submitted
            conn.owned.clear()
            for segment in conn.borrowed:
                self.memory.give_back(segment)
            conn.borrowed.clear()
            assert self.saves is not None
            self.saves.client_gone(conn)
            self.clients -= 1
            self.conns.discard(conn)
            self.admission.leave(conn)
            with contextlib.suppress(Exception):
                await stream.aclose()

    async def _serve(self, conn: Conn) -> None:
        """Answer ``conn``'s requests until it ends or breaks the protocol."""
        buffer = bytearray()
        while True:
            try:
                message = await read_async(conn.stream, buffer, self.frames)
            except p.ProtocolError as exc:
                self.admission.refused["frames"] += 1
                _log.warning("a client's frame was refused: %s", exc)
                await conn.send(p.Error(0, "ProtocolError", str(exc)))
                return
            if message is None:
                return
            ident = getattr(message, "id", 0)
            try:
                await self._handle(conn, message)
            except p.ProtocolError as exc:
                await conn.send(p.Error(ident, "ProtocolError", str(exc)))
                return
            except CheckpointError as exc:
                await conn.send(p.Error(ident, type(exc).__name__, str(exc)))
            except Exception as exc:  # a bug or an OS failure: this client only
                _log.exception("request %s failed", type(message).__name__)
                why = f"the service failed this request ({type(exc).__name__}: {exc})"
                await conn.send(p.Error(ident, "ServiceError", why))
                return

    async def _handle(self, conn: Conn, message: p.Message) -> None:
        saves = self.saves
        assert saves is not None
        match message:
            case p.OpenWriter():
                writer = await saves.open_writer(conn, message)
                await conn.send(p.WriterOpened(message.id, writer.ident))
            case p.Alloc(nbytes=nbytes):
                self.memory.check(nbytes)  # one that can never fit is refused in order
                self.admission.check_segment(
                    conn, ((w.conn, w.pending) for w in saves.writers.values())
                )
                assert conn.tasks is not None
                conn.asking += 1
                conn.tasks.start_soon(self._asked, conn, message)
            case p.Free(id=ident, segment=number):
                if (freed := conn.owned.pop(number, None)) is not None:
                    self.memory.release(freed)
                await conn.send(p.Ok(ident))
            case p.Submit():
                await saves.submit(conn, message)
            case p.Lookup():
                await self._lookup(conn, message)
            case p.Status(id=ident):
                await conn.send(self.status(ident))
            case p.JoinPeers(id=ident):
                self.replicas.join(root_key(message.root, message.storage_options), message)
                await conn.send(p.Ok(ident))
            case _:
                raise p.ProtocolError(f"a {type(message).__name__} is not a request")

    async def _asked(self, conn: Conn, message: p.Alloc) -> None:
        """``_allocate``; ``conn.asking`` counts it until answered."""
        try:
            await self._allocate(conn, message)
        finally:
            conn.asking -= 1

    async def _allocate(self, conn: Conn, message: p.Alloc) -> None:
        """Hand ``conn`` a segment of ``message.nbytes`` once memory allows (or its
        error). A task of the connection's own: while it waits for memory, the
        connection's later frames are still served, among them the ``Free`` of a
        segment asked for ahead that this very allocation may be waiting for."""
        try:
            segment = await self.memory.allocate(message.nbytes)
        except CheckpointError as exc:
            await conn.send(p.Error(message.id, type(exc).__name__, str(exc)))
            return
        except Exception as exc:  # the OS refused a segment: this request only
            _log.exception("a segment of %d bytes failed", message.nbytes)
            why = f"the service failed this request ({type(exc).__name__}: {exc})"
            await conn.send(p.Error(message.id, "ServiceError", why))
            return
        conn.owned[segment.ident] = segment  # before any await: released if conn ends
        await conn.send(p.Segment(message.id, segment.ident, message.nbytes), [segment.fd])

    async def _lookup(self, conn: Conn, message: p.Lookup) -> None:
        """Lend the held step (read-only) to ``conn`` until it ends, or NotHeld."""
        key = root_key(message.root, message.storage_options)
        held, source = self.tier.find(key, message.step, message.rank), "memory"
        if held is not None and message.exact and held.rank not in (None, message.rank):
            held = None  # another local rank's share: not the one asked for
        if held is None:  # a replica another node sent, or fetched from a peer now
            ref, source = ref_of(key, message.step, message.rank), "peer"
            held = self.replicas.find(ref)
            if held is None and (job := self.replicas.job_for(key)) is not None:
                held = await self.peers.fetch(job, ref)
        if held is None:
            await conn.send(p.NotHeld(message.id))
            return
        fd = readonly_fd(held.segment.fd)
        try:
            self.memory.lend(held.segment)
            conn.borrowed.append(held.segment)
            size = held.segment.size
            reply = p.Held(message.id, held.step, held.files, size, source, held.rank)
            await conn.send(reply, [fd])
        finally:
            os.close(fd)

    def status(self, ident: int) -> p.StatusReply:
        kept = self.tier.nbytes
        saves = self.saves
        return p.StatusReply(
            id=ident,
            pid=os.getpid(),
            saves_in_flight=self.in_flight,
            bytes_staged=self.memory.held - kept - self.replicas.nbytes - self.memory.spare,
            bytes_kept=kept,
            memory_limit=self.memory_limit,
            kept=self.tier.steps(),
            clients=self.clients - 1,  # not counting the one asking
            committed=0 if saves is None else saves.committed,
            failed=0 if saves is None else saves.failed,
            refused=dict(self.admission.refused),
            service=self.replicas.service,
            peer_address=self.peers.address,
            replicas_held=self.replicas.count,
            replicas_sent=self.replicas.sent,
            replicas_pending=self.replicas.pending,
            replicas_superseded=self.replicas.superseded,
            replica_bytes_sent=self.replicas.bytes_sent,
            replica_failures=dict(self.replicas.failures),
        )


def serve(
    socket_path: str,
    *,
    memory_limit: int | None = None,
    keep_in_memory: int = 1,
    idle_exit: float | None = None,
    peer_address: str | None = None,
) -> None:
    """Run the service in the foreground until SIGTERM/SIGINT or ``idle_exit``; peers
    reach it on ``peer_address`` (None: the address this node's hostname resolves to)."""
    if keep_in_memory < 0:
        raise errors.InvalidArgumentError(
            f"--keep-in-memory must be 0 or more, not {keep_in_memory}"
        )
    if idle_exit is not None and idle_exit <= 0:
        raise errors.InvalidArgumentError(f"--idle-exit must be positive, not {idle_exit}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s checkpointd serve: %(message)s")
    server = Server(
        socket_path,
        memory_limit=memory_limit,
        keep_in_memory=keep_in_memory,
        idle_exit=idle_exit,
        peer_address=peer_address,
    )
    anyio.run(server.run, backend="asyncio")
