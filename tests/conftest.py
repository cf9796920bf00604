"""Shared fixtures: a real registry and an S3 server (moto) on loopback."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from support import Registry, free_port, require_tool


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """A registry shared by the session; use a unique repository name per test."""
    require_tool("docker-registry")
    reg = Registry(tmp_path_factory.mktemp("registry"))
    yield reg
    reg.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """A moto S3 server on loopback; yields its endpoint URL and sets the boto3 env for it."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in _S3_ENV}
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )
    yield endpoint
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


_S3_ENV = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")


@pytest.fixture
def s3_bucket(s3_server: str) -> str:
    """A fresh bucket on the moto server; yields its name."""
    import uuid

    import boto3

    name = "lb-" + uuid.uuid4().hex[:12]
    boto3.client("s3").create_bucket(Bucket=name)
    return name
