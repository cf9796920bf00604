"""The GPU image's Containerfile, checked without building it (no CUDA base can be pulled here).

It is parsed by BuildKit's own Dockerfile parser (the ``dockerfile`` package wraps it), then
checked: build arguments declared before use, every COPY source present in the build context
that its ignore file leaves, the entrypoint a valid ``runtime serve`` command line, the
exposed port the served one, the model where ``build-image`` puts it.
"""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
from pathlib import Path

import dockerfile
import pytest
from click.testing import CliRunner

from runtime.cli import main

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "runtime" / "container" / "Containerfile"
IGNOREFILE = CONTAINERFILE.with_name("Containerfile.dockerignore")


@pytest.fixture(scope="module")
def instructions() -> list[dockerfile.Command]:
    return list(dockerfile.parse_file(str(CONTAINERFILE)))


def _ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last matching pattern wins; a pattern that matches a
    directory covers everything under it; ``**`` spans any number of directories."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat.removeprefix("!").strip("/")
        rx = re.compile(fnmatch.translate(pat).replace(".*", "[^/]*").replace("[^/]*[^/]*", ".*"))
        if any(rx.fullmatch(p) for p in prefixes):
            ignored = not neg
    return ignored


def _patterns() -> list[str]:
    lines = IGNOREFILE.read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def test_ignore_rules_as_docker_reads_them() -> None:
    pats = ["**", "!runtime", "runtime/.venv-vllm", "**/__pycache__"]
    assert _ignored("imagetool/cli.py", pats)
    assert not _ignored("runtime/launch.py", pats)
    assert _ignored("runtime/.venv-vllm/bin/python", pats)
    assert _ignored("runtime/__pycache__/cli.cpython-311.pyc", pats)


def test_build_args_declared_before_use(instructions) -> None:
    assert instructions[0].cmd == "ARG"  # the base image is a build argument
    first_from = next(i for i, c in enumerate(instructions) if c.cmd == "FROM")
    assert all(c.cmd == "ARG" for c in instructions[:first_from])
    declared: set[str] = set()
    env: set[str] = {"PATH"}
    for c in instructions:
        if c.cmd == "ARG":
            declared.add(c.value[0].split("=")[0])
        elif c.cmd == "ENV":
            env.update(c.value[0::2])
        used = set(re.findall(r"\$\{?(\w+)", " ".join(c.value)))
        assert used <= declared | env, f"line {c.start_line}: {used - declared - env} undeclared"


def test_copy_sources_are_in_the_build_context(instructions) -> None:
    pats = _patterns()
    copies = [c for c in instructions if c.cmd == "COPY"]
    assert copies
    for c in copies:
        assert not c.flags, c.original  # plain COPY: podman, buildah and Docker alike
        for src in c.value[:-1]:
            assert (ROOT / src).exists(), f"{src}: not in the repository"
            assert not _ignored(src, pats), f"{src}: excluded by {IGNOREFILE.name}"
    # what the front imports is in the image; the vLLM venv and caches are not
    # (tests/test_layering.py: runtime imports serving.wire alone, which needs only errors)
    needed = ("runtime/launch.py", "serving/wire/proxy.py", "serving/wire/http1.py",
              "serving/errors.py", "pyproject.toml")  # fmt: skip
    for path in needed:
        assert not _ignored(path, pats), path
    left_out = ("runtime/.venv-vllm/bin/python", "runtime/__pycache__/x.pyc", "tests/x.py",
                "serving/router.py", "serving/kube.py")  # fmt: skip
    for path in left_out:
        assert _ignored(path, pats), path


def test_entrypoint_is_a_valid_serve_command(instructions, tiny_fp8: Path) -> None:
    entry = next(c for c in instructions if c.cmd == "ENTRYPOINT")
    cmd = next(c for c in instructions if c.cmd == "CMD")
    assert entry.json and cmd.json  # exec form: SIGTERM reaches the launcher, not a shell
    argv = list(entry.value) + list(cmd.value)
    assert argv[:4] == ["python", "-m", "runtime.cli", "serve"]
    model = argv[4]
    # the model layer goes where the entrypoint serves it from
    build_image = next(p for p in main.commands["build-image"].params if p.name == "model_path")
    assert "/" + build_image.default == model
    # the exposed port is the one served
    expose = next(c for c in instructions if c.cmd == "EXPOSE")
    assert expose.value == (argv[argv.index("--port") + 1],)
    # the options exist and give the GPU command line
    args = [str(tiny_fp8) if a == model else a for a in argv[3:]]
    r = CliRunner().invoke(main, [*args, "--print-command", "--python", "/opt/venv/bin/python"])
    assert r.exit_code == 0, r.output
    assert "--quantization compressed-tensors" in r.output
    assert "--enforce-eager" not in r.output  # CUDA graphs on the GPU


def _copy_into(src: Path, dest: Path, patterns: list[str]) -> None:
    """COPY's semantics for one source: a file into ``dest`` (a directory when it ends in
    ``/``), a directory's contents onto ``dest``; what the ignore file excludes stays out."""
    files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
    for f in files:
        rel = f.relative_to(ROOT).as_posix()
        if _ignored(rel, patterns):
            continue
        target = dest / f.name if src.is_file() else dest / f.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(f.read_bytes())


def test_what_the_image_copies_of_lazyblock_imports_alone(instructions, tmp_path: Path) -> None:
    """The packages the COPY lines put in /src/lazyblock, and nothing else of this project,
    run the entrypoint's module: an import of a package the image leaves out fails here, as
    it would in the image (the shared command edge ``lazyblock.cli`` was once missing)."""
    pats = _patterns()
    image = tmp_path / "image"
    for c in (c for c in instructions if c.cmd == "COPY"):
        *sources, target = c.value
        assert target.startswith("/src/lazyblock"), c.original
        dest = image / target.lstrip("/")
        for src in sources:
            _copy_into(ROOT / src, dest if target.endswith("/") or not (ROOT / src).is_file()
                       else dest.parent, pats)  # fmt: skip
    src = image / "src" / "lazyblock"
    # -S: no site-packages processing, so the checkout's editable install is not on the path;
    # the third-party packages the front needs come from site-packages as plain directories.
    code = (
        "import sys, site; sys.path[:0] = [sys.argv[1]]; sys.path += site.getsitepackages(); "
        "import runtime.cli, runtime.launch, lazyblock.cli; "
        "assert runtime.cli.__file__.startswith(sys.argv[1]), runtime.cli.__file__; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('lazyblock', 'imagetool', 'snapshotter', 'serving', 'runtime')))"
    )
    r = subprocess.run([sys.executable, "-S", "-c", code, str(src)], capture_output=True,
                       text=True, check=False, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    loaded = {m.split(".")[0] for m in eval(r.stdout)}  # noqa: S307 - our own repr
    assert loaded <= {"lazyblock", "serving", "runtime"}, loaded
