"""Multi-platform block images: ``convert --platform all`` (or a list) converts each platform of
a source image index and publishes an index of the block images; readers pick the running
machine's platform from it (``Store.resolve_ref``), or the one ``--platform`` names.

The source is a real two-platform OCI image index built by hand (``ocibuild``), whose two
images differ in their files; it goes into the directory store, S3 (moto) and the real
docker-registry, and what the registry holds is read back by skopeo too."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import httpx
import pytest
from itool import imagetool
from ocibuild import (
    TarEntry,
    add_image,
    add_index,
    make_layer_tar,
    push_to_registry,
    tag_descriptor,
    write_multiplatform_layout,
    write_oci_layout,
)

from imagetool.errors import InvalidReferenceError, StoreError
from imagetool.format import (
    INDEX_MEDIA_TYPE,
    PLATFORM_INDEX_MEDIA_TYPE,
    Index,
    parse_platform_index,
)
from imagetool.platforms import Platform, default_platform, parse_platform_list
from imagetool.stores import DirStore, StoreOptions, open_store, parse_ref

PLATFORMS = ("linux/amd64", "linux/arm64")


def _layers(platform: str) -> list[bytes]:
    base = make_layer_tar([
        TarEntry("etc", type="dir"),
        TarEntry("etc/os-release", data=b"ID=lazyblock\n"),
        TarEntry("bin", type="dir"),
        TarEntry("bin/tool", data=b"#!/bin/sh\necho tool\n", mode=0o755),
    ])  # fmt: skip
    arch = make_layer_tar([
        TarEntry("etc/arch", data=f"{platform}\n".encode()),
        TarEntry(f"lib-{platform.split('/')[1]}", type="dir"),
        TarEntry(f"lib-{platform.split('/')[1]}/libc.so", data=platform.encode() * 5000),
    ])  # fmt: skip
    return [base, arch]


@pytest.fixture(scope="module")
def two_platforms(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An OCI layout whose tag v1 is an image index of a linux/amd64 and a linux/arm64
    image (files differ: /etc/arch, /lib-<arch>); its source spec."""
    here = default_platform()
    if here not in PLATFORMS:
        pytest.skip(f"this machine is {here}; the test image index has {', '.join(PLATFORMS)}")
    layout = tmp_path_factory.mktemp("multi") / "oci"
    write_multiplatform_layout(layout, {p: _layers(p) for p in PLATFORMS}, "v1")
    return f"oci:{layout}:v1"


def _dest(kind: str, tmp_path: Path, request: pytest.FixtureRequest, name: str) -> str:
    if kind == "dir":
        return f"{tmp_path}/store/{name}"
    if kind == "s3":
        return f"s3://{request.getfixturevalue('s3_bucket')}/images/{name}"
    registry = request.getfixturevalue("registry")
    return f"docker://{registry.host}/multi/{kind}-{tmp_path.name.lower()[-20:]}/{name}"


def _convert(source: str, dest: str, platforms: str, check: bool = True):  # noqa: ANN202
    return imagetool("--plain-http", "convert", "-q", "--platform", platforms, source, dest,
                     check=check)  # fmt: skip


@pytest.mark.parametrize("kind", ["dir", "s3", "registry"])
def test_convert_all_platforms_and_read_each(
    kind: str, two_platforms: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    ref = _dest(kind, tmp_path, request, "app:v1")
    done = _convert(two_platforms, ref, "all")
    digest = done.out.strip()
    assert digest.startswith("sha256:")
    lines = dict(line.split() for line in done.err.strip().splitlines())
    assert sorted(lines) == sorted(PLATFORMS)

    # The reader picks this machine's platform; --platform reads the other one.
    here = default_platform()
    other = next(p for p in PLATFORMS if p != here)
    info = json.loads(imagetool("--plain-http", "inspect", ref).out)
    assert info["source"]["platform"] == here
    assert info["index_digest"] == lines[here]
    assert imagetool("--plain-http", "cat", ref, "/etc/arch").out == f"{here}\n"
    info = json.loads(imagetool("--plain-http", "inspect", "--platform", other, ref).out)
    assert info["source"]["platform"] == other
    assert info["index_digest"] == lines[other]
    assert imagetool("--plain-http", "cat", "--platform", other, ref, "/etc/arch").out == (
        f"{other}\n"
    )
    listing = imagetool("--plain-http", "ls", "--platform", other, ref, "/").out
    assert f"lib-{other.split('/')[1]}" in listing and f"lib-{here.split('/')[1]}" not in listing
    for platform in PLATFORMS:
        verified = imagetool("--plain-http", "verify", "--platform", platform, ref,
                             "--against", two_platforms)  # fmt: skip
        assert ", 0 differ" in verified.out, verified.out

    # A platform the index lacks: one line naming the ones it has.
    missing = imagetool("--plain-http", "cat", "--platform", "linux/s390x", ref, "/etc/arch",
                        check=False)  # fmt: skip
    assert missing.code == 3
    assert missing.err.strip().splitlines() == [
        f"imagetool: error: NotFoundError: {ref}: no image for platform linux/s390x; "
        f"available: {', '.join(sorted(PLATFORMS))}"
    ]

    # Deterministic: converting again (another tag) gives the same digests.
    again = _convert(two_platforms, ref.replace(":v1", ":v2"), "all")
    assert again.out.strip() == digest
    assert dict(line.split() for line in again.err.strip().splitlines()) == lines
    # A list in another order is the same index (the source index's order).
    listed = _convert(two_platforms, ref.replace(":v1", ":v3"), ",".join(reversed(PLATFORMS)))
    assert listed.out.strip() == digest


def test_directory_store_layout(two_platforms: str, tmp_path: Path) -> None:
    """The on-disk form: the tag's ref names the platform index with its media type; the
    index is an OCI image index of the block images' indexes, each in the store."""
    store_dir = tmp_path / "store"
    digest = _convert(two_platforms, f"{store_dir}/app:v1", "all").out.strip()
    assert (store_dir / "refs/app/v1").read_text() == f"{digest} {PLATFORM_INDEX_MEDIA_TYPE}\n"
    store = DirStore(store_dir, "app")
    data = store.read_blob(digest)
    doc = json.loads(data)
    assert doc["mediaType"] == PLATFORM_INDEX_MEDIA_TYPE and doc["schemaVersion"] == 2
    entries = parse_platform_index(data, "test")
    assert [str(e.platform) for e in entries] == list(PLATFORMS)
    for e in entries:
        assert e.media_type == INDEX_MEDIA_TYPE
        index = Index.from_bytes(store.read_blob(e.digest))
        assert index.platform == str(e.platform)
        assert e.size == store.blob_size(e.digest)
    # By digest: the platform index resolves like the tag; an image's index is itself.
    here = PLATFORMS.index(default_platform())
    assert store.resolve_ref(parse_ref(f"{store_dir}/app@{digest}")) == entries[here].digest
    arm = store.resolve_ref(parse_ref(f"{store_dir}/app@{digest}"), "linux/arm64")
    assert arm == entries[1].digest
    assert store.resolve_ref(parse_ref(f"{store_dir}/app@{arm}"), "linux/amd64") == arm
    assert store.list_tags() == ["v1"]
    # A ref line this version does not know is refused as corrupt, not misread.
    (store_dir / "refs/app/v9").write_text(f"{digest} application/x-unknown\n")
    with pytest.raises(StoreError, match="is corrupt"):
        store.resolve("v9")


def test_registry_holds_a_real_image_index(two_platforms: str, registry, tmp_path: Path) -> None:
    """In a registry the tag is an OCI image index of the block images' manifests, each with
    its platform: what containerd resolves. skopeo reads it as such."""
    ref = f"docker://{registry.host}/multi/real:v1"
    digest = _convert(two_platforms, ref, "all").out.strip()
    raw = subprocess.run(
        ["skopeo", "inspect", "--raw", "--tls-verify=false", ref],
        capture_output=True, check=True,
    ).stdout  # fmt: skip
    assert "sha256:" + hashlib.sha256(raw).hexdigest() == digest
    doc = json.loads(raw)
    assert doc["mediaType"] == "application/vnd.oci.image.index.v1+json"
    assert [Platform.from_json(m["platform"]) for m in doc["manifests"]] == [
        Platform.parse(p) for p in PLATFORMS
    ]
    for m, platform in zip(doc["manifests"], PLATFORMS, strict=True):
        assert m["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
        config = json.loads(
            subprocess.run(
                ["skopeo", "inspect", "--config", "--raw", "--tls-verify=false",
                 f"docker://{registry.host}/multi/real@{m['digest']}"],
                capture_output=True, check=True,
            ).stdout
        )  # fmt: skip
        assert f"{config['os']}/{config['architecture']}" == platform
    # The store sees the tag as the index (not followed), and follows it by platform.
    with open_store(ref, StoreOptions(plain_http=True)) as store:
        assert store.resolve_target(parse_ref(ref)) == (digest, PLATFORM_INDEX_MEDIA_TYPE)
        arm_index = store.resolve_ref(parse_ref(ref), "linux/arm64")
        assert Index.from_bytes(store.read_blob(arm_index)).platform == "linux/arm64"
    # The per-platform image by its manifest digest reads as that image.
    arm = doc["manifests"][1]["digest"]
    out = imagetool("--plain-http", "cat", f"docker://{registry.host}/multi/real@{arm}",
                    "/etc/arch").out  # fmt: skip
    assert out == "linux/arm64\n"


@pytest.mark.parametrize("kind", ["dir", "registry"])
def test_a_missing_platform_publishes_nothing(
    kind: str, two_platforms: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    ref = _dest(kind, tmp_path, request, "app:v1")
    failed = _convert(two_platforms, ref, "linux/amd64,linux/ppc64le", check=False)
    assert failed.code == 3
    assert failed.err.strip().splitlines() == [
        f"imagetool: error: NotFoundError: {two_platforms}: no image for platform "
        "linux/ppc64le; available: linux/amd64, linux/arm64"
    ]
    assert failed.out == ""
    if kind == "dir":
        assert not (tmp_path / "store").exists()  # not even a blob
    else:
        registry = request.getfixturevalue("registry")
        repo = parse_ref(ref).name
        resp = httpx.get(f"http://{registry.host}/v2/{repo}/manifests/v1",
                         headers={"Accept": PLATFORM_INDEX_MEDIA_TYPE})  # fmt: skip
        assert resp.status_code == 404
    bad = _convert(two_platforms, ref, "linux/amd64,linux/amd64", check=False)
    assert bad.code == 3 and "names a platform twice" in bad.err


def test_a_single_image_source_with_all(tmp_path: Path) -> None:
    """``--platform all`` of a source that is one image converts that image (and says so);
    a list must name its platform."""
    layout = tmp_path / "one"
    write_oci_layout(layout, _layers("linux/amd64"), tag="v1")
    ref = f"{tmp_path}/store/one:v1"
    done = _convert(f"oci:{layout}:v1", ref, "all")
    assert "is one image, not an index" in done.err
    assert json.loads(imagetool("inspect", ref).out)["index_digest"] == done.out.strip()
    assert (tmp_path / "store/refs/one/v1").read_text() == done.out  # an ordinary image
    refused = _convert(f"oci:{layout}:v1", f"{tmp_path}/store/one:v2", "linux/arm64,linux/amd64",
                       check=False)  # fmt: skip
    assert refused.code == 3 and "is one image for linux/amd64" in refused.err


def test_source_index_from_a_registry(two_platforms: str, registry, tmp_path: Path) -> None:
    """The source itself an image index in a registry (pushed by skopeo --all)."""
    layout = two_platforms.removeprefix("oci:").rsplit(":", 1)[0]
    push_to_registry(Path(layout), "v1", registry.host, "multi/src", all_platforms=True)
    source = f"docker://{registry.host}/multi/src:v1"
    from_registry = _convert(source, f"{tmp_path}/store/app:v1", "all").out.strip()
    from_layout = _convert(two_platforms, f"{tmp_path}/store/app:v2", "all").out.strip()
    assert from_registry == from_layout


def test_all_skips_attestations(two_platforms: str, tmp_path: Path) -> None:
    """buildx's attestation manifests (platform unknown/unknown, in-toto layers) are not
    images to run: ``all`` leaves them out, as containerd does."""
    layout = tmp_path / "attested"
    descs = [add_image(layout, _layers(p), platform=p) for p in PLATFORMS]
    attestation = add_image(layout, [b'{"_type": "https://in-toto.io/Statement/v0.1"}'],
                            media_types=["application/vnd.in-toto+json"],
                            platform="unknown/unknown")  # fmt: skip
    # first, so that even the probe of the index's platforms must pass it by
    tag_descriptor(layout, add_index(layout, [attestation, *descs]), "v1")
    attested = _convert(f"oci:{layout}:v1", f"{tmp_path}/store/app:v1", "all")
    plain = _convert(two_platforms, f"{tmp_path}/store/app:v2", "all")
    assert attested.out == plain.out and attested.err == plain.err


def test_platform_lists() -> None:
    assert parse_platform_list("all") is None
    assert parse_platform_list(" linux/amd64, linux/arm64/v8 ") == (
        Platform("linux", "amd64"),
        Platform("linux", "arm64", "v8"),
    )
    for bad in ("", ",", "linux", "linux/amd64,linux/x86_64"):
        with pytest.raises(InvalidReferenceError):
            parse_platform_list(bad)
