"""Where ``--model`` (and ``--tokenizer``) point: a directory, a Hugging Face cache entry, or a
repo id found in the local Hugging Face cache. Never the network.

The Hugging Face hub cache keeps one folder per repo, ``models--ORG--NAME``, with
``snapshots/REVISION/`` holding the files (symlinks into ``blobs/``) and ``refs/main`` naming
the revision a plain download resolved to. So all of these serve the same checkpoint:

    --model /data/SmolLM2-135M-Instruct                       (a plain directory)
    --model ~/.cache/huggingface/hub/models--HuggingFaceTB--SmolLM2-135M-Instruct
    --model ~/.cache/huggingface/hub/models--HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/REV
    --model HuggingFaceTB/SmolLM2-135M-Instruct               (looked up in the cache)
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from pathlib import Path

from tpserve.args import ServerArgs
from tpserve.errors import ConfigError

# Repo ids as the hub allows them: ORG/NAME of letters, digits, '-', '_' and '.'.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def hub_cache_dirs(env: Mapping[str, str] | None = None) -> list[Path]:
    """Cache roots, in huggingface_hub's order of precedence (first match wins there)."""
    env = os.environ if env is None else env
    home = Path(env.get("HOME") or Path.home())
    xdg = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else home / ".cache"
    hf_home = Path(env["HF_HOME"]) if env.get("HF_HOME") else xdg / "huggingface"
    candidates = [env.get("HF_HUB_CACHE"), env.get("HUGGINGFACE_HUB_CACHE"), str(hf_home / "hub"),
                  str(home / ".cache" / "huggingface" / "hub")]
    seen: list[Path] = []
    for c in candidates:
        if c and Path(c).expanduser() not in seen:
            seen.append(Path(c).expanduser())
    return seen


def _is_cache_repo(path: Path) -> bool:
    return path.name.startswith("models--") and (path / "snapshots").is_dir()


def _snapshot(repo: Path, flag: str) -> Path:
    """The snapshot ``refs/main`` names; a lone snapshot when there is no ref."""
    ref = repo / "refs" / "main"
    snapshots = repo / "snapshots"
    if ref.is_file():
        chosen = snapshots / ref.read_text().strip()
        if chosen.is_dir():
            return chosen
        raise ConfigError(f"{ref} names snapshot '{chosen.name}', which is not in {snapshots}",
                          flag=flag)
    found = sorted(p for p in snapshots.iterdir() if p.is_dir())
    if len(found) == 1:
        return found[0]
    names = ", ".join(p.name for p in found) or "none"
    raise ConfigError(f"{repo} has no refs/main and {len(found)} snapshots ({names}); "
                      f"pass one snapshot directory", flag=flag)


def resolve_model_path(model: str, flag: str = "--model",
                       env: Mapping[str, str] | None = None) -> Path:
    """The directory holding the checkpoint's files, or ConfigError naming where it looked."""
    path = Path(model).expanduser()
    if path.is_dir():
        return _snapshot(path, flag) if _is_cache_repo(path) else path
    if _REPO_ID.match(model):
        folder = "models--" + model.replace("/", "--")
        roots = hub_cache_dirs(env)
        for root in roots:
            if _is_cache_repo(root / folder):
                return _snapshot(root / folder, flag)
        looked = ", ".join(str(r / folder) for r in roots)
        raise ConfigError(f"'{model}' is not a directory, and no Hugging Face cache holds it "
                          f"(looked in {looked}); tpserve never downloads: fetch it first "
                          "(e.g. `huggingface-cli download " + model + "`) or pass a directory",
                          flag=flag)
    what = "tokenizer" if flag == "--tokenizer" else "model"
    raise ConfigError(f"{what} directory '{model}' does not exist", flag=flag)


def resolve_args(args: ServerArgs, env: Mapping[str, str] | None = None) -> ServerArgs:
    """``args`` with ``--model`` / ``--tokenizer`` replaced by the directories they name."""
    model = str(resolve_model_path(args.model, "--model", env)) if args.model else None
    tokenizer = (str(resolve_model_path(args.tokenizer, "--tokenizer", env))
                 if args.tokenizer else None)
    return dataclasses.replace(args, model=model, tokenizer=tokenizer)
