"""A real registry over TLS, with a certificate from a throwaway CA: ranged reads (through
``http.client``, ``imagetool.registry.ranged``) and everything else (httpx) verify it alike, and
refuse a server that the trusted CAs did not sign."""

from __future__ import annotations

import datetime
import ipaddress
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from support import ForwardProxy, Registry, require_tool

from imagetool.errors import StoreError
from imagetool.format import BLOB_MEDIA_TYPE
from imagetool.registry.ranged import DirectBody
from imagetool.stores import StoreOptions
from imagetool.stores.registry import RegistryStore


def _ca(tmp: Path, name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(hours=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    path = tmp / f"{name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert, path


@pytest.fixture
def tls_registry(tmp_path: Path) -> Iterator[tuple[Registry, Path]]:
    """A registry serving TLS for 127.0.0.1; yields it and the CA bundle that signed it."""
    require_tool("docker-registry")
    ca_key, ca_cert, ca_pem = _ca(tmp_path, "lazyblock-test-ca")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(hours=2))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_pem, key_pem = tmp_path / "server.pem", tmp_path / "server.key"
    cert_pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_pem.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    root = tmp_path / "registry"
    root.mkdir()
    tls = f"  tls:\n    certificate: {cert_pem}\n    key: {key_pem}\n"
    registry = Registry(root, extra_config=tls)
    yield registry, ca_pem
    registry.stop()


@pytest.mark.integration
def test_registry_over_tls(tls_registry, tmp_path: Path, image, monkeypatch) -> None:
    registry, ca_pem = tls_registry
    options = StoreOptions(timeout=10, docker_config=tmp_path / "none.json")
    repo = f"lb/tls{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("SSL_CERT_FILE", str(ca_pem))
    with RegistryStore(registry.host, repo, options) as store:
        store.put_blob(image.blob_digest, image.blob, BLOB_MEDIA_TYPE)  # httpx
        with store.open_range(image.blob_digest, 5, 1000) as body:
            assert isinstance(body, DirectBody)
            got = bytearray(1000)
            body.readinto(memoryview(got))
        assert got == image.blob[5:1005]
        assert store.read_range(image.blob_digest, 0, 64) == image.blob[:64]
        assert store.client._ranges.disabled is None

    # Another CA trusted: both clients refuse the server.
    _, _, other_pem = _ca(tmp_path, "someone-else")
    monkeypatch.setenv("SSL_CERT_FILE", str(other_pem))
    with RegistryStore(registry.host, repo, options) as store:
        with pytest.raises(StoreError, match="CERTIFICATE_VERIFY_FAILED|certificate verify"):
            store.read_range(image.blob_digest, 0, 64)


@pytest.mark.integration
def test_ranged_reads_through_a_connect_tunnel(tls_registry, tmp_path: Path, image, monkeypatch):
    """HTTPS_PROXY: the data path's fast client tunnels through a real proxy (CONNECT) and
    verifies the registry's certificate inside the tunnel."""
    require_tool("tinyproxy")
    registry, ca_pem = tls_registry
    proxy = ForwardProxy(tmp_path / "proxy", auth=("node", "pw"))
    try:
        for name in ("HTTP_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "no_proxy"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("SSL_CERT_FILE", str(ca_pem))
        options = StoreOptions(timeout=10, docker_config=tmp_path / "none.json")
        repo = f"lb/tunnel{uuid.uuid4().hex[:8]}"
        with RegistryStore(registry.host, repo, options) as store:
            store.put_blob(image.blob_digest, image.blob, BLOB_MEDIA_TYPE)
        monkeypatch.setenv("HTTPS_PROXY", proxy.url)
        with RegistryStore(registry.host, repo, options) as store:
            for offset in (0, 100, 7):
                with store.open_range(image.blob_digest, offset, 500) as body:
                    assert isinstance(body, DirectBody)
                    got = bytearray(500)
                    body.readinto(memoryview(got))
                assert got == image.blob[offset : offset + 500]
            # One tunnel, kept for the three reads.
            assert store.client._ranges.connections_opened == 1
        assert [r.rsplit(" ", 1)[0] for r in proxy.requests()] == [f"CONNECT {registry.host}"]
    finally:
        proxy.stop()
