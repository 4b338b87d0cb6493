"""--model as a directory, a Hugging Face cache entry, or a repo id in the local cache.

The cache layout is built the way huggingface_hub writes it (snapshots of symlinks into
blobs/, refs/main naming the revision); nothing touches the network.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tpserve.args import ServerArgs
from tpserve.demo import DEMO_NAME, demo_target, served_name
from tpserve.errors import ConfigError
from tpserve.model_path import hub_cache_dirs, resolve_args, resolve_model_path

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"


def fake_cache(root: Path, repo: str = REPO, revs: tuple[str, ...] = ("a1b2", "c3d4"),
               main: str | None = "c3d4") -> Path:
    """models--ORG--NAME/{blobs,snapshots/REV,refs/main} as huggingface_hub lays them out."""
    folder = root / ("models--" + repo.replace("/", "--"))
    (folder / "blobs").mkdir(parents=True)
    for rev in revs:
        snap = folder / "snapshots" / rev
        snap.mkdir(parents=True)
        blob = folder / "blobs" / f"sha-{rev}"
        blob.write_text(f'{{"rev": "{rev}"}}')
        (snap / "config.json").symlink_to(blob)
    if main:
        (folder / "refs").mkdir()
        (folder / "refs" / "main").write_text(main)
    return folder


def test_plain_directory_is_itself(tmp_path: Path) -> None:
    assert resolve_model_path(str(tmp_path)) == tmp_path


def test_cache_folder_and_snapshot(tmp_path: Path) -> None:
    folder = fake_cache(tmp_path)
    assert resolve_model_path(str(folder)) == folder / "snapshots" / "c3d4"
    snap = folder / "snapshots" / "a1b2"
    assert resolve_model_path(str(snap)) == snap
    assert (resolve_model_path(str(folder)) / "config.json").read_text() == '{"rev": "c3d4"}'


def test_repo_id_in_hf_hub_cache(tmp_path: Path) -> None:
    fake_cache(tmp_path / "hub")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HOME": str(tmp_path / "home")}
    assert resolve_model_path(REPO, env=env) == \
        tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / "c3d4"


def test_repo_id_in_hf_home_and_default_cache(tmp_path: Path) -> None:
    fake_cache(tmp_path / "hfhome" / "hub")
    assert resolve_model_path(REPO, env={"HF_HOME": str(tmp_path / "hfhome"),
                                         "HOME": str(tmp_path)}).parent.name == "snapshots"
    fake_cache(tmp_path / "home" / ".cache" / "huggingface" / "hub", "org/other")
    assert resolve_model_path("org/other", env={"HOME": str(tmp_path / "home")}).name == "c3d4"


def test_unknown_repo_names_where_it_looked(tmp_path: Path) -> None:
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HOME": str(tmp_path / "home")}
    with pytest.raises(ConfigError) as err:
        resolve_model_path("org/missing", env=env)
    msg = str(err.value)
    assert str(tmp_path / "hub" / "models--org--missing") in msg
    assert str(tmp_path / "home" / ".cache" / "huggingface" / "hub" / "models--org--missing") in msg
    assert "never downloads" in msg and err.value.flag == "--model"
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_model_path(str(tmp_path / "no" / "such" / "dir"), env=env)


def test_without_refs_main(tmp_path: Path) -> None:
    one = fake_cache(tmp_path / "one", revs=("r1",), main=None)
    assert resolve_model_path(str(one)).name == "r1"
    two = fake_cache(tmp_path / "two", main=None)
    with pytest.raises(ConfigError, match="no refs/main and 2 snapshots"):
        resolve_model_path(str(two))


def test_hub_cache_precedence() -> None:
    dirs = hub_cache_dirs({"HF_HUB_CACHE": "/a", "HF_HOME": "/b", "HOME": "/h"})
    assert dirs == [Path("/a"), Path("/b/hub"), Path("/h/.cache/huggingface/hub")]
    assert hub_cache_dirs({"XDG_CACHE_HOME": "/x", "HOME": "/h"})[0] == Path("/x/huggingface/hub")


def test_resolve_args_and_served_name(tmp_path: Path) -> None:
    fake_cache(tmp_path / "hub")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HOME": str(tmp_path)}
    args = resolve_args(ServerArgs(model=REPO, tokenizer=REPO), env)
    assert Path(args.model or "").name == "c3d4" and args.tokenizer == args.model
    assert served_name(Path(args.model or "")) == REPO
    assert served_name(Path(args.model or ""), "my-model") == "my-model"
    assert served_name(demo_target()) == DEMO_NAME
    assert served_name(tmp_path / "Llama-3.1-8B") == "Llama-3.1-8B"
    assert resolve_args(ServerArgs()).model is None
