"""A sync botocore S3 client for an S3 store's bulk transfers (ranged GETs, upload parts).

s3fs sends every request through aiobotocore on its one event-loop thread: requests in
flight at once share that thread's CPU, on top of a copy of each part into ``bytes``.
``SyncS3`` sends each request from a worker thread through one botocore client (thread
safe) whose urllib3 pool holds a connection per worker; the GIL is released while bytes
move. It is built from the s3fs file system's own settings (credentials or anon, the
endpoint, region, client and config kwargs, profile), so it reaches what s3fs reaches;
``SyncS3.build`` returns None where a setting has no sync equivalent (requester pays,
version awareness, extra per-call kwargs, a caller's own session, region caching), and
the store keeps s3fs's path.

Parts carry their own CRC32C (``checksums``; s3upload.py). Over plain http botocore
would also SHA-256 every body into the signature (over https it does not): a request
that carries ``x-amz-checksum-crc32c`` is sent as ``UNSIGNED-PAYLOAD`` instead, as
botocore itself does over https with a checksum. The checksum header stays signed, so
the bytes are still checked end to end by a store that verifies checksums; an explicit
``payload_signing_enabled`` in ``config_kwargs["s3"]`` wins, and
``request_checksum_calculation="when_required"`` (for stores that refuse checksum
headers) turns both off.

Errors leave as s3fs's do: a ``ClientError`` becomes the OSError s3fs would raise (its
``__cause__`` the ClientError), and the transient errors s3fs retries (a dropped or cut
connection, a timeout, an unparsable reply, SlowDown), and a body refused as changed on
the way (BadDigest: it is sent again from the same buffer), are retried the same number
of times with backoff, on top of botocore's own retries. Blocking; any thread.
"""

from __future__ import annotations

import concurrent.futures
import functools
import http.client
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import botocore.config
import botocore.exceptions
import botocore.parsers
import botocore.session
from botocore import UNSIGNED
from s3fs.errors import translate_boto_error

from checkpointd import tunables

__all__ = ["SyncS3"]

_CLIENT_KEYS = frozenset(
    {
        "region_name",
        "endpoint_url",
        "use_ssl",
        "verify",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "aws_account_id",
        "api_version",
    }
)
"""``client_kwargs`` that botocore's ``create_client`` takes as they are (not ``config``:
it may be aiobotocore's own type)."""

_RETRYABLE = (
    socket.timeout,
    http.client.IncompleteRead,
    botocore.exceptions.HTTPClientError,
    botocore.parsers.ResponseParserError,
)
_SLOW_DOWN = ("SlowDown", "reduce your request rate", "XAmzContentSHA256Mismatch", "BadDigest")
"""Refusals tried again: throttling, and a body that arrived other than it was sent."""

_CHECKSUM_HEADER = "x-amz-checksum-crc32c"
_CHECKSUMMED = ("PutObject", "UploadPart")
"""The operations whose body goes unsigned when it carries ``_CHECKSUM_HEADER``."""

_sessions_lock = threading.Lock()
_sessions: dict[str | None, botocore.session.Session] = {}


def _session(profile: str | None, like: Any) -> botocore.session.Session:
    """One botocore session per profile for the process: its service model is parsed once,
    by the data loader of the botocore session ``like`` where given (s3fs's own)."""
    with _sessions_lock:
        session = _sessions.get(profile)
        if session is None:
            session = botocore.session.Session(profile=profile)
            if isinstance(like, botocore.session.Session):
                session.register_component("data_loader", like.get_component("data_loader"))
            _sessions[profile] = session
        return session


def _client_args(fs: Any) -> dict[str, Any] | None:
    """``create_client`` kwargs equivalent to what s3fs's ``set_session`` builds from
    ``fs``'s settings, plus the profile under "profile"; None where one cannot be mapped."""
    extra = dict(fs.kwargs)
    profile = extra.pop("profile", None)
    if (
        extra
        or fs.requester_pays
        or fs.version_aware
        or fs.s3_additional_kwargs
        or fs.cache_regions
        or set(fs.client_kwargs) - _CLIENT_KEYS
    ):
        return None
    args: dict[str, Any] = {
        "aws_access_key_id": fs.key,
        "aws_secret_access_key": fs.secret,
        "aws_session_token": fs.token,
        "endpoint_url": fs.endpoint_url,
        "use_ssl": fs.use_ssl,
    }
    args = {k: v for k, v in args.items() if v is not None}
    args.update(fs.client_kwargs)
    config = dict(fs.config_kwargs)
    config.setdefault("connect_timeout", fs.connect_timeout)
    config.setdefault("read_timeout", fs.read_timeout)
    if fs.anon:
        for secret in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token"):
            args.pop(secret, None)
        config["signature_version"] = UNSIGNED
    return {"args": args, "config": config, "profile": profile}


def _unsigned_body(unsigned: botocore.config.Config, request: Any, **_: Any) -> None:
    """botocore's ``before-sign`` hook: a body that carries its CRC32C is signed as
    ``UNSIGNED-PAYLOAD`` (botocore's S3 signer reads the choice from the request's
    client config, which is this request's own). Worker thread."""
    if _CHECKSUM_HEADER in request.headers:
        request.context["client_config"] = unsigned


class SyncS3:
    """One botocore client and ``threads`` workers for one store (see the module doc)."""

    def __init__(self, client: Any, threads: int, retries: int) -> None:
        self._client = client
        self._retries = max(1, retries)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="checkpointd-s3"
        )
        self.threads = threads
        config = client.meta.config
        self.checksums: bool = config.request_checksum_calculation != "when_required"
        """Whether uploads should send a CRC32C with each part (s3upload.py)."""
        if self.checksums and (config.s3 or {}).get("payload_signing_enabled") is None:
            unsigned = config.merge(
                botocore.config.Config(s3={**(config.s3 or {}), "payload_signing_enabled": False})
            )
            for operation in _CHECKSUMMED:
                client.meta.events.register(
                    f"before-sign.s3.{operation}", functools.partial(_unsigned_body, unsigned)
                )

    @classmethod
    def build(cls, fs: Any, threads: int) -> SyncS3 | None:
        """A client reaching what the s3fs file system ``fs`` reaches, with a pool of
        ``threads`` connections; None where ``fs``'s settings cannot be mapped (or
        botocore refuses them)."""
        mapped = _client_args(fs)
        if mapped is None:
            return None
        config = {**mapped["config"]}
        config["max_pool_connections"] = max(threads, int(config.get("max_pool_connections", 0)))
        try:
            client = _session(mapped["profile"], fs.session).create_client(
                "s3", config=botocore.config.Config(**config), **mapped["args"]
            )
        except (TypeError, ValueError, botocore.exceptions.BotoCoreError):
            return None
        return cls(client, threads, int(fs.retries))

    def call(self, method: str, **kwargs: Any) -> dict[str, Any]:
        """One S3 API call on this thread, retried and translated as the module doc says."""
        result: dict[str, Any] = self.retried(lambda: self.once(method, **kwargs))
        return result

    def once(self, method: str, **kwargs: Any) -> dict[str, Any]:
        """One S3 API call on this thread with botocore's retries only; raw botocore
        errors (for ``retried`` to wrap, with whatever reads the reply)."""
        operation: Callable[..., dict[str, Any]] = getattr(self._client, method)
        return operation(**kwargs)

    def retried(self, attempt: Callable[[], Any]) -> Any:
        """``attempt()`` (one request and whatever reads its reply), tried again after a
        transient error, up to the file system's retries; errors translated."""
        for number in range(self._retries):
            try:
                return attempt()
            except _RETRYABLE:
                if number + 1 == self._retries:
                    raise
            except botocore.exceptions.ClientError as exc:
                if number + 1 == self._retries or not any(s in str(exc) for s in _SLOW_DOWN):
                    raise translate_boto_error(exc) from exc
            pause = tunables.S3_RETRY_FIRST_SECONDS * tunables.S3_RETRY_GROWTH**number
            time.sleep(min(pause, tunables.S3_RETRY_MAX_SECONDS))
        raise AssertionError("unreachable")  # pragma: no cover

    def submit(self, method: str, **kwargs: Any) -> concurrent.futures.Future[dict[str, Any]]:
        """``call`` on a worker thread; at most ``threads`` run at once, the rest queue."""
        return self._pool.submit(self.call, method, **kwargs)

    def run(self, job: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """``job()`` on a worker thread (it makes its own calls through ``call``)."""
        return self._pool.submit(job)

    def close(self, *, wait: bool = True) -> None:
        """Close the client's connections, after the workers finish if ``wait``; the
        client must not be used afterwards. Idempotent."""
        self._pool.shutdown(wait=wait)
        self._client.close()
