"""S3Store's client models, parsed ahead (``s3.preload``) for the processes that build
clients later: the mount fork server's children."""

from __future__ import annotations

import boto3
import botocore.loaders
import pytest
from botocore.config import Config

from imagetool.stores import s3


def test_clients_after_a_preload_parse_nothing_and_take_the_callers_credentials(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "preloader-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "preloader-secret")
    s3.preload()
    parsed: list[str] = []
    real = botocore.loaders.JSONFileLoader.load_file

    def load_file(self: botocore.loaders.JSONFileLoader, path: str) -> object:
        parsed.append(path)
        return real(self, path)

    monkeypatch.setattr(botocore.loaders.JSONFileLoader, "load_file", load_file)
    # a mount server: its own environment, no boto3 session yet
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "caller-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "caller-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    client = s3._new_client(Config())
    try:
        assert parsed == []  # every data file came parsed
        assert client.meta.region_name == "eu-west-1"
        credentials = client._request_signer._credentials
        assert (credentials.access_key, credentials.secret_key) == ("caller-key", "caller-secret")
    finally:
        client.close()
