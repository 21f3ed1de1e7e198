"""Shared fixtures: roots on memory://, local disk and S3 (moto's server over real HTTP)."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

# One intra-op thread per process, set before torch is imported here, in the xdist workers
# (started after this is read) and in every child they start: the suite runs two workers and
# their children on two cores, where torch's default of a thread per core had OpenMP's
# threads spin-waiting for each other (a 100-step demo: 4.6 s of CPU, 2.9 s with one).
# A value set by the caller is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from tests.support.s3 import MotoS3, start_moto
from tests.support.s3rver import S3rver, S3rverMissing, start_s3rver


@dataclass(frozen=True)
class Root:
    """A checkpoint root and the storage options to reach it."""

    url: str
    storage_options: dict[str, Any] | None = field(default=None)
    kind: str = "local"


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3]:
    """One moto S3 server on 127.0.0.1 (a free port) for the whole session."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = start_moto()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_root(moto_s3: MotoS3) -> Root:
    """A fresh bucket on the moto server, as an s3:// root with its storage options."""
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    moto_s3.create_bucket(bucket)
    return Root(f"s3://{bucket}/run", moto_s3.storage_options(), "s3")


@pytest.fixture(scope="session")
def s3rver() -> Iterator[S3rver]:
    """One s3rver (a second S3 implementation, without If-None-Match) for the session.

    Skips where s3rver is not installed, except under CI (env CI set), where that fails."""
    try:
        server = start_s3rver()
    except S3rverMissing as exc:
        if os.environ.get("CI"):
            pytest.fail(str(exc))
        pytest.skip(str(exc))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3rver_root(s3rver: S3rver) -> Root:
    """A fresh bucket on s3rver, as an s3:// root with its storage options."""
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    s3rver.create_bucket(bucket)
    return Root(f"s3://{bucket}/run", s3rver.storage_options(), "s3rver")


@pytest.fixture
def local_root(tmp_path: Any) -> Root:
    return Root(str(tmp_path / "ckpt"), None, "local")


@pytest.fixture
def memory_root() -> Root:
    return Root(f"memory://ckpt-{uuid.uuid4().hex[:12]}", None, "memory")


@pytest.fixture
def dictfs_root() -> Root:
    """A root on the example backend of tests/support/dict_store.py (registers dictfs://)."""
    import tests.support.dict_store  # noqa: F401 - registers the protocol

    return Root(f"dictfs://ckpt-{uuid.uuid4().hex[:12]}", None, "dictfs")


@pytest.fixture(params=["memory", "local", "s3"])
def any_root(request: pytest.FixtureRequest) -> Root:
    """Each test using this runs once per backend."""
    root: Root = request.getfixturevalue(f"{request.param}_root")
    return root


# Roots on GCS (fake-gcs-server, gcp-storage-emulator) and Azure (Azurite) emulators.
from tests.support.cloud_roots import (  # noqa: E402
    azure_root,
    azurite,
    fake_gcs,
    gcs_emulator,
    gcs_root,
    gcsemu_root,
)

__all__ = ["azure_root", "azurite", "fake_gcs", "gcs_emulator", "gcs_root", "gcsemu_root"]


@pytest.fixture(scope="session", autouse=True)
def _zygote_stopped() -> Iterator[None]:
    """The rank zygote (tests/support/zygote.py), if a test started it, ends with the session."""
    yield
    from tests.support.zygote import stop_shared

    stop_shared()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with the kinds of cost it carries (tests/support/kinds.py)."""
    from tests.support.kinds import mark_kinds

    mark_kinds(items)
