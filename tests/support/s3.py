"""A real S3-compatible server for tests: moto in server mode, on loopback, a free port."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import boto3
from moto.server import ThreadedMotoServer

CREDENTIALS = {"key": "testing", "secret": "testing"}
REGION = "us-east-1"


class S3Endpoint:
    """What the tests need from any S3 server: s3fs options, a boto3 client, buckets."""

    endpoint: str
    credentials: dict[str, str] = CREDENTIALS

    def storage_options(self, endpoint: str | None = None) -> dict[str, Any]:
        """s3fs options that reach this server (or ``endpoint``, e.g. a fault proxy in front)."""
        return {
            **self.credentials,
            "client_kwargs": {"endpoint_url": endpoint or self.endpoint, "region_name": REGION},
            "skip_instance_cache": True,
        }

    def client(self) -> Any:
        """A boto3 S3 client for checks from the test's side."""
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.credentials["key"],
            aws_secret_access_key=self.credentials["secret"],
            region_name=REGION,
        )

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)


@dataclass
class MotoS3(S3Endpoint):
    server: ThreadedMotoServer
    endpoint: str

    def stop(self) -> None:
        self.server.stop()


def start_moto() -> MotoS3:
    """Start moto's S3 server on 127.0.0.1 with an OS-chosen port."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return MotoS3(server, f"http://{host}:{port}")
