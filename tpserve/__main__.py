"""``torchrun --nproc-per-node N -m tpserve [flags]`` (or ``python -m tpserve`` for TP=1)."""

from __future__ import annotations

import logging
import os
import sys

from tpserve.args import parse_args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"[%(asctime)s rank{rank}] %(levelname)s %(name)s: %(message)s")
    from tpserve.serve import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
