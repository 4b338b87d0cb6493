"""``tpserve.malloc_preload``: which library is chosen, when the process re-executes itself
with it in ``LD_PRELOAD`` (and when not), and a real server that did so."""

from __future__ import annotations

import os
from collections.abc import MutableMapping, Sequence
from pathlib import Path

import httpx
import pytest

from tests.server_proc import running_server
from tpserve.malloc_preload import (
    DONE,
    ENV,
    LIBRARIES,
    active_malloc,
    find_library,
    preload_malloc,
    preloaded,
)


class FakeExec:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str, list[str], dict[str, str]]] = []
        self.fail = fail

    def __call__(self, exe: str, argv: Sequence[str], env: MutableMapping[str, str]) -> None:
        self.calls.append((exe, list(argv), dict(env)))
        if self.fail:
            raise OSError("exec refused")


def _libs(tmp: Path, *names: str) -> list[str]:
    for name in names:
        (tmp / name).write_bytes(b"")
    return [str(tmp)]


def test_auto_takes_the_first_installed_library_in_order(tmp_path: Path) -> None:
    dirs = _libs(tmp_path, LIBRARIES[2], LIBRARIES[0])
    assert find_library("auto", dirs) == str(tmp_path / LIBRARIES[0])
    assert find_library("off", dirs) is None
    assert find_library("auto", [str(tmp_path / "empty")]) is None
    mine = tmp_path / "libmine.so"
    mine.write_bytes(b"")
    assert find_library(str(mine), []) == str(mine)
    assert find_library(str(tmp_path / "missing.so"), dirs) is None


def test_reexecutes_once_with_the_library_first_in_ld_preload(tmp_path: Path) -> None:
    dirs = _libs(tmp_path, LIBRARIES[0])
    fake = FakeExec()
    env = {"LD_PRELOAD": "/opt/other.so", "KEEP": "1"}
    preload_malloc(env, ["python", "-m", "tpserve", "--port", "1"], "/usr/bin/python3", fake,
                   dirs)
    assert len(fake.calls) == 1
    exe, argv, child = fake.calls[0]
    assert exe == "/usr/bin/python3" and argv == ["python", "-m", "tpserve", "--port", "1"]
    assert child["LD_PRELOAD"] == f"{tmp_path / LIBRARIES[0]} /opt/other.so"
    assert child[DONE] == "1" and child["KEEP"] == "1"
    assert preloaded(child) == str(tmp_path / LIBRARIES[0])
    assert env == {"LD_PRELOAD": "/opt/other.so", "KEEP": "1"}  # this process's is untouched


@pytest.mark.parametrize("env", [
    {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"},  # the user preloaded one already
    {DONE: "1"},  # re-executed once: a library the loader refused must not loop
    {ENV: "off"},
])
def test_no_reexecution(tmp_path: Path, env: dict[str, str]) -> None:
    fake = FakeExec()
    preload_malloc(env, ["python"], "python", fake, _libs(tmp_path, LIBRARIES[0]))
    assert fake.calls == []


def test_nothing_installed_or_exec_refused_keeps_running(tmp_path: Path) -> None:
    fake = FakeExec()
    preload_malloc({}, ["python"], "python", fake, [str(tmp_path)])
    assert fake.calls == []
    failing = FakeExec(fail=True)
    preload_malloc({}, ["python"], "python", failing, _libs(tmp_path, LIBRARIES[1]))
    assert len(failing.calls) == 1  # tried, failed, returned: the server starts on glibc


def test_reported_only_where_the_loader_mapped_it(tmp_path: Path) -> None:
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    maps = tmp_path / "maps"
    maps.write_text(f"7f00-7f01 r-xp 00000000 00:00 1 {lib}\n")
    env = {"LD_PRELOAD": str(lib)}
    assert active_malloc(env, str(maps)) == str(lib)
    maps.write_text("7f00-7f01 r-xp 00000000 00:00 1 /usr/lib/libc.so.6\n")
    assert active_malloc(env, str(maps)) == "glibc"  # named, but the loader refused it
    assert active_malloc({}, str(maps)) == "glibc"


def _libm() -> str:
    """A harmless library to preload: the C math library this interpreter already maps."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if "/libm.so" in path or "/libm-" in path:
            return path
    pytest.skip("no libm mapped here")


def test_a_real_server_runs_on_the_preloaded_library(tmp_path: Path) -> None:
    """``TPSERVE_MALLOC=<path>``: the torchrun worker re-executes itself with it preloaded
    (a copy of libm named like TCMalloc, so this runs where TCMalloc is not installed), serves,
    and reports it; its process maps it."""
    fake_tcmalloc = tmp_path / "libtcmalloc_minimal_test.so"
    fake_tcmalloc.symlink_to(_libm())
    with running_server(1, cache=tmp_path, env={ENV: str(fake_tcmalloc)}) as (url, _):
        info = httpx.get(url + "/get_server_info", timeout=30).json()
        assert info["host_malloc"] == str(fake_tcmalloc)
        pid = info["rank_pids"][0]
        assert str(fake_tcmalloc) in Path(f"/proc/{pid}/maps").read_text() or \
            os.path.realpath(fake_tcmalloc) in Path(f"/proc/{pid}/maps").read_text()
        out = httpx.post(url + "/generate", json={"text": "def f(x):", "sampling_params": {
            "max_new_tokens": 4, "temperature": 0}}, timeout=60).json()
        assert out["meta_info"]["completion_tokens"] == 4
