"""An https mirror in a hosts directory, as containerd's ``certs.d/HOST/hosts.toml`` sets it up:
trusted through its ``ca``, reached with a ``client`` certificate where it asks for one, or
without verification (``skip_verify``). A real TLS server (``support.MirrorServer`` over
Python's ``ssl``) in front of a real registry, with a CA, a server and a client certificate
made for the test. A mirror the node cannot trust, or that refuses the node, is passed over
for the registry, and the read still succeeds."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from support import MirrorServer
from test_registry_mirrors import BLOB, _hosts, _push

from imagetool.stores.registry import RegistryStore

pytestmark = pytest.mark.usefixtures("fresh_mirror_health")


@dataclass(frozen=True)
class Pki:
    ca: Path  # the CA's certificate (PEM)
    server_cert: Path  # for IP 127.0.0.1, signed by the CA
    server_key: Path
    client_cert: Path  # clientAuth, signed by the CA
    client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Path:
    path.with_suffix(".key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _issue(
    subject: str,
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    *,
    usage: ExtendedKeyUsageOID | None = None,
    ip: str | None = None,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, issuer_key = (ca[0].subject, ca[1]) if ca else (_name(subject), key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca is None, path_length=None), critical=True)
    )
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if ip is not None:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256()), key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    where = tmp_path_factory.mktemp("pki")
    ca = _issue("lazyblock test CA", None)
    server = _issue("mirror", ca, usage=ExtendedKeyUsageOID.SERVER_AUTH, ip="127.0.0.1")
    client = _issue("node", ca, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    server_cert = _write(where / "mirror.crt", *server)
    client_cert = _write(where / "node.cert", *client)
    return Pki(
        ca=_write(where / "ca.crt", *ca),
        server_cert=server_cert,
        server_key=server_cert.with_suffix(".key"),
        client_cert=client_cert,
        client_key=client_cert.with_suffix(".key"),
    )


def _tls_mirror(upstream: str, pki: Pki, require_client: bool = False) -> MirrorServer:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki.server_cert, pki.server_key)
    if require_client:
        context.load_verify_locations(cafile=pki.ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return MirrorServer(upstream, tls=context)


def _read_through(registry_host: str, tmp_path: Path, mirror: MirrorServer, host_lines: str):
    """One blob read with a hosts.toml naming the https ``mirror`` (with ``host_lines``)
    before the registry: the stats of (mirror, server)."""
    repo, digest = _push(registry_host, tmp_path)
    options = _hosts(
        tmp_path, registry_host,
        f'server = "http://{registry_host}"\n'
        f'[host."https://{mirror.host}"]\n  capabilities = ["pull"]\n{host_lines}',
    )  # fmt: skip
    with RegistryStore(registry_host, repo, options) as store:
        assert store.read_range(digest, 1000, 300_000) == BLOB[1000:301_000]
        mirror_stats, server_stats = store.source_stats()
    return mirror_stats, server_stats


@pytest.fixture
def mirror_of(registry, pki) -> Iterator:
    made: list[MirrorServer] = []

    def make(require_client: bool = False) -> MirrorServer:
        made.append(_tls_mirror(registry.host, pki, require_client))
        return made[-1]

    yield make
    for m in made:
        m.stop()


# hosts.toml lines of the mirror's entry, from the test's certificates.
CA = 'ca = "{pki.ca}"'
CLIENT = 'client = [["{pki.client_cert}", "{pki.client_key}"]]'


@pytest.mark.parametrize(
    ("require_client", "lines"),
    [
        (False, [CA]),  # trusted through its ca
        (False, ["skip_verify = true"]),  # not verified: reached all the same
        (True, [CA, CLIENT]),  # it asks for a client certificate, and gets one
    ],
    ids=["ca", "skip_verify", "client_certificate"],
)
def test_mirror_serves_the_read(
    registry, pki, tmp_path, mirror_of, require_client: bool, lines: list[str]
) -> None:
    mirror = mirror_of(require_client)
    host_lines = "".join(f"  {line.format(pki=pki)}\n" for line in lines)
    m, s = _read_through(registry.host, tmp_path, mirror, host_lines)
    assert mirror.blob_reads() == 1 and mirror.handshake_failures == 0
    assert (m["requests"], m["bytes"], m["errors"]) == (1, 300_000, 0)
    assert s["requests"] == 0


@pytest.mark.parametrize(
    ("require_client", "lines"),
    [
        (False, []),  # signed by a CA the node was not told of
        (True, [CA]),  # it asks for a client certificate the node does not have
    ],
    ids=["untrusted", "no_client_certificate"],
)
def test_mirror_the_handshake_fails_with_is_passed_over(
    registry, pki, tmp_path, mirror_of, require_client: bool, lines: list[str]
) -> None:
    """The handshake fails, the mirror is backed off and counted, the registry serves the
    read."""
    mirror = mirror_of(require_client)
    host_lines = "".join(f"  {line.format(pki=pki)}\n" for line in lines)
    m, s = _read_through(registry.host, tmp_path, mirror, host_lines)
    assert mirror.blob_reads() == 0 and mirror.handshake_failures >= 1
    assert m["errors"] == 1 and m["bytes"] == 0
    assert (s["requests"], s["bytes"]) == (1, 300_000)
