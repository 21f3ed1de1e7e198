"""The peer port: TCP between the services of a job, for replicas (wire/peers.py).

Incoming: each connection is admitted like a local one (its own share of the caps:
every peer connection counts as one client), must prove a job's key within
``tunables.PEER_HANDSHAKE_SECONDS`` (frames of at most ``PEER_HANDSHAKE_BYTES`` until
then), and only then may push a share of that job's root or fetch one; a connection
that does not prove it is answered nothing more and closed, counted in ``refused``
as ``peers``. Outgoing: after a save, a rank's share goes to the job's next services
in the ring (``push``), from its held segment (pinned while it is read, no copy); a
restore whose node lacks a share fetches it from the job's other services (``fetch``).
A share's bytes go raw after its frame, once the receiver said it has the memory
(``SharedMemory.allocate_now``: a replica never waits for memory nor evicts this
node's own steps), and must arrive at ``PEER_MIN_BYTES_PER_SECOND`` at least. On the
service's event loop. No torch here.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Callable

import anyio
import anyio.to_thread
from anyio.abc import ByteStream, SocketAttribute, SocketListener, SocketStream, TaskGroup

from checkpointd import tunables
from checkpointd.daemon.server.admission import Admission, accept_loop
from checkpointd.daemon.server.conn import Conn
from checkpointd.daemon.server.memory import SharedMemory
from checkpointd.daemon.server.memtier import HeldCheckpoint, MemoryTier, RootKey
from checkpointd.daemon.server.priority import lowest
from checkpointd.daemon.server.replica_bytes import deadline, mismatched, move
from checkpointd.daemon.server.replicas import PeerJob, Replicas, own_share, ref_of, ring
from checkpointd.daemon.wire import peers as w
from checkpointd.daemon.wire import protocol as p
from checkpointd.daemon.wire.bounds import FrameBudget
from checkpointd.daemon.wire.frames import read_async
from checkpointd.errors import CheckpointError

__all__ = ["PEER_PID", "PeerPort", "peer_host"]

_log = logging.getLogger(__name__)

PEER_PID = -1
"""The client identity every peer connection is admitted under (admission.py)."""


def peer_host(given: str | None) -> str | None:
    """The address to listen on for peers: ``given`` (``--peer-address``), else the one
    this node's hostname resolves to; None if that does not resolve."""
    host = given or socket.gethostname()
    try:
        return str(socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][4][0])
    except (OSError, IndexError):
        if given:
            raise
        return None


class _Link:
    """One peer connection: frames and raw bytes on ``stream``."""

    def __init__(self, stream: ByteStream, frames: FrameBudget) -> None:
        self.stream = stream
        self.frames = frames
        self.buffer = bytearray()

    async def read(self, most: int) -> w.PeerMessage | None:
        """The next frame's message (at most ``most`` bytes); ProtocolError otherwise."""
        message: w.PeerMessage | None = await read_async(
            self.stream, self.buffer, self.frames, decoder=w.decode_peer, limit=lambda _: most
        )
        return message

    async def send(self, message: w.PeerMessage) -> None:
        await self.stream.send(w.encode_peer(message))

    async def done(self, seconds: float | None = None) -> w.PeerDone:
        """The other side's ``PeerDone`` within ``seconds`` (default ``FRAME_SECONDS``);
        ProtocolError for anything else."""
        with anyio.fail_after(tunables.FRAME_SECONDS if seconds is None else seconds):
            reply = await self.read(tunables.MAX_REQUEST_BYTES)
        if not isinstance(reply, w.PeerDone):
            raise p.ProtocolError(f"a peer answered {type(reply).__name__}, not PeerDone")
        return reply


class PeerPort:
    """The peer port of one service and its transfers. Event loop."""

    def __init__(
        self,
        memory: SharedMemory,
        tier: MemoryTier,
        replicas: Replicas,
        admission: Admission,
        frames: FrameBudget,
    ) -> None:
        self.memory = memory
        self.tier = tier
        self.replicas = replicas
        self.admission = admission
        self.frames = frames
        self.address: str | None = None
        """HOST:PORT once listening."""
        self.group: TaskGroup | None = None
        self.busy: Callable[[], int] = lambda: 0
        """How many of this node's saves are in flight (staged or being written): a
        replica's transfer waits for none (``until_idle``); ``memory.notify`` wakes it."""

    async def until_idle(self) -> None:
        """Until this node has no save in flight, or ``PEER_IDLE_WAIT_SECONDS`` passed
        (a node that saves back to back still sends its replicas). Event loop."""
        with anyio.move_on_after(tunables.PEER_IDLE_WAIT_SECONDS):
            while self.busy():
                await self.memory.wait()  # notified as a save resolves or memory frees

    async def listen(self, host: str) -> SocketListener:
        """Listen on an ephemeral port of ``host``; ``address`` says where."""
        multi = await anyio.create_tcp_listener(local_host=host, local_port=0)
        listener = multi.listeners[0]
        assert isinstance(listener, SocketListener)
        port = listener.extra(SocketAttribute.local_port)
        self.address = f"{host}:{port}"
        return listener

    async def serve(self, listener: SocketListener, group: TaskGroup) -> None:
        """Accept peer connections until cancelled."""
        self.group = group
        await accept_loop(listener, self._accepted, group, self.admission.refused)

    # -- incoming ---------------------------------------------------------------

    async def _accepted(self, stream: SocketStream) -> None:
        conn = Conn(stream, PEER_PID)
        try:
            if self.admission.admit(conn) is not None:
                return  # counted; a peer that has not proven anything is told nothing
            try:
                link = _Link(stream, self.frames)
                job = None
                with anyio.move_on_after(tunables.PEER_HANDSHAKE_SECONDS):
                    job = await self._prove(link)
                if job is None:
                    self.admission.refused["peers"] += 1
                    return
                await self._requests(link, job)
            except p.ProtocolError as exc:
                self.admission.refused["frames"] += 1
                _log.warning("a peer connection was refused: %s", exc)
            except (anyio.BrokenResourceError, anyio.EndOfStream, OSError, TimeoutError) as exc:
                _log.warning("a peer connection broke: %r", exc)
            finally:
                self.admission.leave(conn)
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()

    async def _prove(self, link: _Link) -> PeerJob | None:
        """The job whose key the connecting side proves, or None."""
        hello = await link.read(tunables.PEER_HANDSHAKE_BYTES)
        if not isinstance(hello, w.Hello) or len(hello.nonce) != w.NONCE_BYTES:
            return None
        job = self.replicas.jobs.get(hello.job)
        if job is None:
            return None
        mine = w.new_nonce()
        await link.send(w.Challenge(mine, w.proof(job.key, "accept", hello.nonce, mine)))
        answer = await link.read(tunables.PEER_HANDSHAKE_BYTES)
        if not isinstance(answer, w.Proof):
            return None
        if not w.proven(job.key, "connect", hello.nonce, mine, answer.proof):
            return None
        return job

    async def _requests(self, link: _Link, job: PeerJob) -> None:
        """Serve an authenticated connection's pushes and fetches until it ends."""
        while True:
            message = await link.read(tunables.MAX_FRAME_BYTES)
            if message is None:
                return
            if isinstance(message, w.PushReplica):
                if not job.names(message.ref):
                    await link.send(w.PeerDone(False, "not this job's root"))
                    continue
                await self.until_idle()  # this node's saves first
                held = await self._receive(link, message)
                if held is not None:
                    self.replicas.add(message.ref, held)
            elif isinstance(message, w.FetchReplica):
                found = None
                if job.names(message.ref):
                    found = self.replicas.find(message.ref) or own_share(self.tier, message.ref)
                if found is None:
                    await link.send(w.PeerDone(False, "not held"))
                else:
                    await self._send(link, message.ref, found)
            else:
                raise p.ProtocolError(f"a {type(message).__name__} is not a peer request")

    # -- a share's bytes ------------------------------------------------------------

    async def _send(
        self, link: _Link, ref: w.ReplicaRef, held: HeldCheckpoint, *, push: bool = False
    ) -> bool:
        """Offer ``held`` and send its bytes if the other side takes it; True once held
        there. ``push``: the other side may first wait for its own saves to finish."""
        segment = held.segment
        self.memory.pin(segment)
        try:
            await link.send(w.PushReplica(ref, held.files, segment.size))
            wait = tunables.PEER_IDLE_WAIT_SECONDS if push else 0.0
            reply = await link.done(tunables.FRAME_SECONDS + wait)
            if reply.ok:
                # the other side read the offer before it answered: nothing of ours is left
                # in the transport, and the segment goes from its mapping to the socket
                until = time.monotonic() + deadline(segment.size)
                await anyio.to_thread.run_sync(lowest, move, link.stream, segment, until, True)
                # the other side checks every file's CRC32C before it answers
                reply = await link.done(tunables.FRAME_SECONDS + deadline(segment.size))
            if not reply.ok:  # the offer or the bytes refused
                self.replicas.failures[f"peer refused: {reply.why}"] += 1
            return reply.ok
        finally:
            self.memory.unpin(segment)

    async def _receive(self, link: _Link, offer: w.PushReplica) -> HeldCheckpoint | None:
        """Take ``offer``'s bytes into a segment of this service's; None if it does not
        fit (the other side is told so). ProtocolError for an offer that does not add up."""
        size = offer.size
        if size < 0 or any(
            f.offset < 0 or f.length < 0 or f.offset + f.length > size for f in offer.files
        ):
            await link.send(w.PeerDone(False, "malformed"))
            raise p.ProtocolError("a replica whose files do not lie in its bytes")
        try:
            segment = await self.memory.allocate_now(size, self.replicas.evict_oldest)
        except CheckpointError:
            segment = None
        if segment is None:
            self.replicas.failures["no memory"] += 1
            await link.send(w.PeerDone(False, "no memory"))
            return None
        try:
            await link.send(w.PeerDone(True, "send"))
            if link.buffer:  # the other side sends the bytes only once told to
                raise p.ProtocolError("a peer sent bytes before it was asked for them")
            # read from the socket into the mapping directly, off the event loop (the
            # transport reads only inside a receive: none runs meanwhile), then check it
            until = time.monotonic() + deadline(size)
            await anyio.to_thread.run_sync(lowest, move, link.stream, segment, until, False)
            damaged = await anyio.to_thread.run_sync(lowest, mismatched, segment, offer.files)
            if damaged is not None:
                self.replicas.failures["damaged on arrival"] += 1
                _log.warning(
                    "dropped the replica of rank %d step %d of %s: %s does not match its CRC32C",
                    offer.ref.rank,
                    offer.ref.step,
                    offer.ref.root,
                    damaged,
                )
                await link.send(w.PeerDone(False, "damaged on arrival"))
                self.memory.release(segment)
                return None
            await link.send(w.PeerDone(True))
        except BaseException:
            self.memory.release(segment)
            raise
        return HeldCheckpoint(
            step=offer.ref.step, segment=segment, files=offer.files, rank=offer.ref.rank
        )

    # -- outgoing -------------------------------------------------------------------

    async def _connect(self, job: PeerJob, address: str) -> _Link:
        """An authenticated connection to the service at ``address`` for ``job``."""
        host, port = address.rsplit(":", 1)
        with anyio.fail_after(tunables.PEER_CONNECT_SECONDS):
            stream = await anyio.connect_tcp(host, int(port))
        link = _Link(stream, self.frames)
        try:
            nonce = w.new_nonce()
            await link.send(w.Hello(job.job, nonce))
            with anyio.fail_after(tunables.PEER_HANDSHAKE_SECONDS):
                challenge = await link.read(tunables.PEER_HANDSHAKE_BYTES)
            if not isinstance(challenge, w.Challenge) or not w.proven(
                job.key, "accept", nonce, challenge.nonce, challenge.proof
            ):
                raise p.ProtocolError(f"the peer at {address} did not prove the job's key")
            await link.send(w.Proof(w.proof(job.key, "connect", nonce, challenge.nonce)))
        except BaseException:
            await stream.aclose()
            raise
        return link

    def added(self, key: RootKey, held: HeldCheckpoint) -> None:
        """The memory tier now holds ``held``: if a job of this root replicates the rank's
        share, send it to the job's next services, in the background, once this node has
        no save in flight (``until_idle``)."""
        job = self.replicas.job_for(key, writing=True)
        if job is None or held.rank is None or held.rank not in job.ranks or not job.replicas:
            return
        if self.group is None:
            return
        ref = ref_of(key, held.step, held.rank)
        for target in self.replicas.targets(job):
            self.replicas.pending += 1  # at once: status counts it from here
            self.group.start_soon(self._push, job, target.address, key, ref, held)

    def _superseded(self, key: RootKey, held: HeldCheckpoint) -> bool:
        """True if this node holds a newer step of ``held``'s rank of root ``key`` (only
        the newest matters to a restore: its push goes instead)."""
        return any(h.rank == held.rank and h.step > held.step for h in self.tier.roots.get(key, []))

    async def _push(
        self, job: PeerJob, address: str, key: RootKey, ref: w.ReplicaRef, held: HeldCheckpoint
    ) -> None:
        self.memory.pin(held.segment)  # at once: the tier may let it go before this runs
        try:
            await self.until_idle()  # this node's saves first
            if self._superseded(key, held):
                self.replicas.superseded += 1
                return
            link = await self._connect(job, address)
            try:
                if await self._send(link, ref, held, push=True):
                    self.replicas.sent += 1
                    self.replicas.bytes_sent += held.segment.size
            finally:
                await link.stream.aclose()
        except Exception as exc:
            self.replicas.failures[f"send: {type(exc).__name__}"] += 1
            _log.warning(
                "replica of rank %d step %d to %s failed: %r", ref.rank, ref.step, address, exc
            )
        finally:
            self.replicas.pending -= 1
            self.memory.unpin(held.segment)

    async def fetch(self, job: PeerJob, ref: w.ReplicaRef) -> HeldCheckpoint | None:
        """The share ``ref`` from the first of ``job``'s other services that holds it
        (held here as a replica from then on), or None."""
        if self.replicas.keep <= 0:
            return None
        for target in ring(job.services, self.replicas.service, len(job.services)):
            try:
                link = await self._connect(job, target.address)
                try:
                    await link.send(w.FetchReplica(ref))
                    with anyio.fail_after(tunables.FRAME_SECONDS):
                        offer = await link.read(tunables.MAX_FRAME_BYTES)
                    if not isinstance(offer, w.PushReplica) or offer.ref != ref:
                        continue
                    held = await self._receive(link, offer)
                finally:
                    await link.stream.aclose()
            except Exception as exc:
                self.replicas.failures[f"fetch: {type(exc).__name__}"] += 1
                _log.warning(
                    "fetching rank %d step %d from %s failed: %r",
                    ref.rank,
                    ref.step,
                    target.address,
                    exc,
                )
                continue
            if held is not None:
                self.replicas.add(ref, held)
                self.replicas.fetched += 1
                return self.replicas.find(ref)
        return None
