"""The built-in demo pair, shipped inside the package (no downloads, no first-run build).

``target/``: a small Llama (8 layers, 8 heads: TP = 1, 2, 4, 8 all divide it) trained on the
Python standard library's source with ``python -m tpserve.train.target``; ``draft/``: its
EAGLE-3 draft from ``python -m tpserve.train.eagle3``. Without ``--model`` the server serves
the target, and ``--speculative-algorithm EAGLE3`` without a draft path uses the draft.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tpserve.args import ServerArgs
from tpserve.errors import ConfigError

DEMO_NAME = "tpserve-demo"


def demo_target() -> Path:
    return _packaged("target")


def demo_draft() -> Path:
    return _packaged("draft")


def _packaged(name: str) -> Path:
    path = Path(__file__).resolve().parent / name
    if not (path / "model.safetensors").is_file():
        raise ConfigError(f"the built-in demo checkpoint is missing from {path} "
                          "(reinstall tpserve, or pass --model DIR)", flag="--model")
    return path


def is_demo_target(model: str | Path | None) -> bool:
    if model is None:
        return True
    here = Path(__file__).resolve().parent / "target"
    return Path(model).resolve() == here


def served_name(model_dir: Path, override: str | None = None) -> str:
    """The model id the API reports: ``--served-model-name``, else a stable name for the
    demo, else the directory name (a Hugging Face cache snapshot: its repo id, ORG/NAME)."""
    if override:
        return override
    if is_demo_target(model_dir):
        return DEMO_NAME
    path = Path(model_dir)
    repo = path.parent.parent.name if path.parent.name == "snapshots" else ""
    if repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/", 1)
    return path.name


def with_demo_defaults(args: ServerArgs) -> ServerArgs:
    """EAGLE-3 on the built-in target without a draft path means the shipped draft."""
    if (args.speculative_algorithm and str(args.speculative_algorithm).lower() != "none"
            and not args.speculative_draft_model_path and is_demo_target(args.model)):
        return dataclasses.replace(args, speculative_draft_model_path=str(demo_draft()))
    return args
