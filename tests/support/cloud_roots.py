"""Fixtures for roots on GCS and Azure emulators (imported by tests/conftest.py).

Each emulator is started once per session on 127.0.0.1 by the tests themselves;
each root is a fresh bucket or container. Where an emulator is not installed
its tests skip, unless ``CI`` is set, in which case they fail.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from tests.support.azurite import Azurite, AzuriteMissing, start_azurite
from tests.support.gcs import (
    GCSEmulatorMissing,
    GCSEndpoint,
    start_fake_gcs_server,
    start_gcp_storage_emulator,
)

T = TypeVar("T")


def _started(start: Callable[[], T], missing: type[Exception]) -> T:
    try:
        return start()
    except missing as exc:
        if os.environ.get("CI"):
            pytest.fail(str(exc))
        pytest.skip(str(exc))


def _root() -> Any:
    from tests.conftest import Root

    return Root


@pytest.fixture(scope="session")
def fake_gcs() -> Iterator[GCSEndpoint]:
    """fake-gcs-server (honours ifGenerationMatch=0) for the whole session."""
    server = _started(start_fake_gcs_server, GCSEmulatorMissing)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[GCSEndpoint]:
    """gcp-storage-emulator (ignores ifGenerationMatch) for the whole session."""
    server = _started(start_gcp_storage_emulator, GCSEmulatorMissing)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def gcs_root(fake_gcs: GCSEndpoint) -> Any:
    """A fresh bucket on fake-gcs-server, as a gs:// root."""
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    fake_gcs.create_bucket(bucket)
    return _root()(f"gs://{bucket}/run", fake_gcs.storage_options(), "gcs")


@pytest.fixture
def gcsemu_root(gcs_emulator: GCSEndpoint) -> Any:
    """A fresh bucket on gcp-storage-emulator, as a gcs:// root (no exclusive create)."""
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    gcs_emulator.create_bucket(bucket)
    return _root()(f"gcs://{bucket}/run", gcs_emulator.storage_options(), "gcsemu")


@pytest.fixture(scope="session")
def azurite() -> Iterator[Azurite]:
    """Azurite's blob service (its well-known dev account) for the whole session."""
    server = _started(start_azurite, AzuriteMissing)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def azure_root(azurite: Azurite) -> Any:
    """A fresh container on Azurite, as an az:// root."""
    container = f"ckpt-{uuid.uuid4().hex[:12]}"
    azurite.create_container(container)
    return _root()(f"az://{container}/run", azurite.storage_options(), "azure")
