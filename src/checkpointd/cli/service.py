"""``checkpointd serve`` and ``checkpointd status``: parse, call the daemon package, print.

``status`` imports no torch (it only talks to the socket).
"""

from __future__ import annotations

import argparse
import json

from checkpointd.cli.output import size_text

__all__ = ["cmd_serve", "cmd_status"]


def cmd_serve(args: argparse.Namespace) -> int:
    """``checkpointd serve``: run the checkpoint service in the foreground until signalled.

    It logs to stderr at INFO (``logging.basicConfig``).

    Args:
        args: The parsed command line (cli/parser.py).

    Returns:
        The exit status: 0 once it has stopped.
    """
    from checkpointd.daemon.server.priority import lower_priority
    from checkpointd.daemon.server.server import serve
    from checkpointd.daemon.wire.paths import default_socket, parse_size

    limit = None if args.memory_limit is None else parse_size(args.memory_limit)
    lower_priority(args.niceness, args.io_priority)
    serve(
        args.socket or default_socket(),
        memory_limit=limit,
        keep_in_memory=args.keep_in_memory,
        idle_exit=args.idle_exit,
        peer_address=args.peer_address,
    )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """``checkpointd status``: what the checkpoint service holds and does, or ``--json``.

    Args:
        args: The parsed command line (cli/parser.py).

    Returns:
        The exit status: 0 (no service answering is an error: status 1).
    """
    import msgspec

    from checkpointd.daemon.client.client import status
    from checkpointd.daemon.server.memtier import shown_key

    reply = status(args.socket or "auto")
    kept = {shown_key(root): steps for root, steps in reply.kept.items()}  # no credentials
    if args.json:
        fields = msgspec.structs.asdict(reply)
        fields.pop("id")
        fields["kept"] = kept
        print(json.dumps(fields))
        return 0
    limit = "no limit" if reply.memory_limit is None else size_text(reply.memory_limit)
    print(f"checkpoint service pid {reply.pid}: {reply.clients} client(s)")
    print(
        f"saves in flight: {reply.saves_in_flight} ({reply.committed} committed, {reply.failed} failed)"
    )
    print(
        f"memory: {size_text(reply.bytes_staged)} staged, {size_text(reply.bytes_kept)} kept "
        f"({limit})"
    )
    for root, steps in kept.items():
        print(f"kept in memory: {root}: steps {', '.join(map(str, steps))}")
    if reply.peer_address is not None:
        print(
            f"peers at {reply.peer_address}: {reply.replicas_held} replica(s) held, "
            f"{reply.replicas_sent} sent ({size_text(reply.replica_bytes_sent)}), "
            f"{reply.replicas_pending} pending, {reply.replicas_superseded} superseded"
        )
    if reply.replica_failures:
        failures = sorted(reply.replica_failures.items())
        print("replica failures: " + ", ".join(f"{n} {why}" for why, n in failures))
    if reply.refused:
        print("refused: " + ", ".join(f"{n} {kind}" for kind, n in sorted(reply.refused.items())))
    return 0
