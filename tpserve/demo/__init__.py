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

DEMO_NAME = "tpserve-demo"


def demo_target() -> Path:
    return _packaged("target")


def demo_draft() -> Path:
    return _packaged("draft")


def _packaged(name: str) -> Path:
    path = Path(__file__).resolve().parent / name
    if not (path / "model.safetensors").is_file():
        raise SystemExit(f"error: the built-in demo checkpoint is missing from {path} "
                         "(reinstall tpserve, or pass --model DIR)")
    return path


def is_demo_target(model: str | Path | None) -> bool:
    if model is None:
        return True
    here = Path(__file__).resolve().parent / "target"
    return Path(model).resolve() == here


def served_name(model_dir: Path) -> str:
    """The model id the API reports: a stable name for the demo, else the directory name."""
    return DEMO_NAME if is_demo_target(model_dir) else Path(model_dir).name


def with_demo_defaults(args: ServerArgs) -> ServerArgs:
    """EAGLE-3 on the built-in target without a draft path means the shipped draft."""
    if (args.speculative_algorithm and str(args.speculative_algorithm).lower() != "none"
            and not args.speculative_draft_model_path and is_demo_target(args.model)):
        return dataclasses.replace(args, speculative_draft_model_path=str(demo_draft()))
    return args
