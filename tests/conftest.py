"""Shared fixtures: roots on memory://, local disk and S3 (moto's server over real HTTP)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.support.s3 import MotoS3, start_moto


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


@pytest.fixture
def local_root(tmp_path: Any) -> Root:
    return Root(str(tmp_path / "ckpt"), None, "local")


@pytest.fixture
def memory_root() -> Root:
    return Root(f"memory://ckpt-{uuid.uuid4().hex[:12]}", None, "memory")


@pytest.fixture(params=["memory", "local", "s3"])
def any_root(request: pytest.FixtureRequest) -> Root:
    """Each test using this runs once per backend."""
    root: Root = request.getfixturevalue(f"{request.param}_root")
    return root
