"""Keys and the bind-address check, the guard's routing of keys, and private trace files."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tpserve.args import ServerArgs, parse_args
from tpserve.engine.trace_files import PrivateDirError, check_private_dir, write_private
from tpserve.errors import ConfigError
from tpserve.server.guard import Guard, GuardConfig
from tpserve.server.security import check_bind_security, is_loopback, resolve_keys
from tpserve.server.trace_dir import TraceRequestError, check_name, trace_path


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_needs_no_key(host: str) -> None:
    assert is_loopback(host)
    check_bind_security(ServerArgs(host=host))


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "myhost.example"])
def test_beyond_loopback_without_a_key_is_refused(host: str, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("TPSERVE_API_KEY", raising=False)
    monkeypatch.delenv("TPSERVE_ADMIN_API_KEY", raising=False)
    assert not is_loopback(host)
    with pytest.raises(ConfigError, match="--allow-unauthenticated") as info:
        check_bind_security(ServerArgs(host=host))
    assert info.value.flag == "--api-key"
    check_bind_security(ServerArgs(host=host, api_key="k"))
    monkeypatch.setenv("TPSERVE_API_KEY", "from-env")
    check_bind_security(ServerArgs(host=host))
    monkeypatch.delenv("TPSERVE_API_KEY")
    with caplog.at_level(logging.WARNING, logger="tpserve"):
        check_bind_security(ServerArgs(host=host, allow_unauthenticated=True))
    assert "WITHOUT AN API KEY" in caplog.text and "/admin/*" in caplog.text


def test_flags_and_key_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TPSERVE_API_KEY", raising=False)
    monkeypatch.delenv("TPSERVE_ADMIN_API_KEY", raising=False)
    args = parse_args(["--api-key", "a", "--allow-unauthenticated", "--profile-dir", "/x"])
    assert args.allow_unauthenticated and args.profile_dir == "/x"
    assert resolve_keys(args).admin == "a"  # the admin key defaults to the API key
    assert resolve_keys(parse_args(["--api-key", "a", "--admin-api-key", "b"])).admin == "b"
    assert resolve_keys(ServerArgs()).api is None and not resolve_keys(ServerArgs()).any


def _guarded(cfg: GuardConfig, seen: list[tuple[str, str, int]]) -> TestClient:
    app = FastAPI()

    @app.get("/generate")
    @app.get("/admin/config")
    @app.get("/health")
    def ok() -> dict[str, str]:
        return {"ok": "yes"}

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("a bug")

    app.add_middleware(Guard, cfg=cfg, on_response=lambda *a: seen.append(a))
    return TestClient(app, raise_server_exceptions=False)


@pytest.mark.parametrize("api,admin", [("u", "a"), ("u", "u"), (None, "a"), ("u", None)])
def test_admin_routes_take_only_the_admin_key(api: str | None, admin: str | None) -> None:
    client = _guarded(GuardConfig(api, 1 << 20, admin), [])

    def status(path: str, key: str | None) -> int:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return client.get(path, headers=headers).status_code

    assert status("/health", None) == 200
    assert status("/admin/config", admin) == 200
    assert status("/admin/config", None) == (401 if admin else 200)
    if api and admin and api != admin:
        assert status("/admin/config", api) == 401
        assert status("/generate", admin) == 200  # the admin key opens every route
    assert status("/generate", api) == 200
    assert status("/generate", None) == (401 if api else 200)


def test_unhandled_error_is_a_json_500() -> None:
    seen: list[tuple[str, str, int]] = []
    r = _guarded(GuardConfig(None, 1 << 20), seen).get("/boom")
    assert r.status_code == 500 and r.json()["error"]["code"] == 500
    assert seen[-1] == ("GET", "/boom", 500)


def test_private_dir_is_created_0700_and_checked(tmp_path: Path) -> None:
    root = tmp_path / "a" / "traces"
    check_private_dir(str(root))
    assert root.is_dir() and (root.stat().st_mode & 0o777) == 0o700
    root.chmod(0o755)
    with pytest.raises(PrivateDirError, match="mode 0700"):
        check_private_dir(str(root))
    root.chmod(0o700)
    (tmp_path / "link").symlink_to(root)
    with pytest.raises(PrivateDirError, match="symlink"):
        check_private_dir(str(tmp_path / "link"))


def test_trace_replaces_a_planted_symlink_instead_of_following_it(tmp_path: Path) -> None:
    root = tmp_path / "traces"
    check_private_dir(str(root))
    victim = tmp_path / "victim"
    (root / "t.json").symlink_to(victim)
    write_private(str(root / "t.json"), lambda p: Path(p).write_text(json.dumps({"ok": 1})))
    assert not (root / "t.json").is_symlink() and not victim.exists()
    assert json.loads((root / "t.json").read_text()) == {"ok": 1}
    assert sorted(os.listdir(root)) == ["t.json"]  # the temporary file was renamed, not left

    def fail(path: str) -> None:
        raise RuntimeError("export failed")

    with pytest.raises(RuntimeError):
        write_private(str(root / "u.json"), fail)
    assert sorted(os.listdir(root)) == ["t.json"]


@pytest.mark.parametrize("name", ["..", ".", ".hidden", "a/b", "../x", "", "x" * 101, "a b"])
def test_bad_trace_names(name: str) -> None:
    with pytest.raises(ValueError, match="invalid trace name"):
        check_name(name)


def test_trace_path_reports_an_unsafe_directory(tmp_path: Path) -> None:
    (tmp_path / "shared").mkdir(mode=0o777)
    (tmp_path / "shared").chmod(0o777)
    with pytest.raises(TraceRequestError, match="mode 0700"):
        trace_path(ServerArgs(profile_dir=str(tmp_path / "shared")), "t.json")
    path = trace_path(ServerArgs(profile_dir=str(tmp_path / "own")), None)
    assert path.startswith(str(tmp_path / "own") + "/") and path.endswith(".json")
