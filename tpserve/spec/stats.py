"""Speculation statistics: accept lengths overall, per draft position and per request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tpserve.engine.request import Request
from tpserve.spec.verify import Accepted


@dataclass
class SpecStats:
    steps: int = 0
    verify_ct: int = 0  # verified trees (one per request per step)
    accepted_drafts: int = 0
    position_accepts: list[int] = field(default_factory=list)  # [d]: trees accepting > d drafts

    def record(self, accepted: list[Accepted], depth: int) -> None:
        # The depth can change live: grow the per-position counters.
        self.position_accepts += [0] * max(0, depth - len(self.position_accepts))
        self.steps += 1
        self.verify_ct += len(accepted)
        for acc in accepted:
            drafts = len(acc.nodes) - 1
            self.accepted_drafts += drafts
            for d in range(drafts):
                self.position_accepts[d] += 1

    def snapshot(self) -> dict[str, Any]:
        if not self.verify_ct:
            return {"steps": self.steps, "verify_ct": 0}
        return {"steps": self.steps, "verify_ct": self.verify_ct,
                "accepted_drafts": self.accepted_drafts,
                "avg_accept_length": 1 + self.accepted_drafts / self.verify_ct,
                "position_accept_rate": [c / self.verify_ct for c in self.position_accepts]}


def record_request(req: Request, acc: Accepted) -> None:
    """Per-request counters, reported in the request's ``meta_info``."""
    stats = req.stats
    stats["spec_verify_ct"] = stats.get("spec_verify_ct", 0) + 1
    hist = stats.setdefault("spec_accept_histogram", [])
    drafts = len(acc.nodes) - 1
    while len(hist) <= drafts:
        hist.append(0)
    hist[drafts] += 1  # hist[i]: verify steps that accepted exactly i draft tokens
    stats["spec_accept_length"] = len(req.output_ids) / stats["spec_verify_ct"]
