"""The adaptive chooser's gauges exist from the first scrape (NaN until there is a number)."""

from __future__ import annotations

import math

from tpserve.server.metrics import _adaptive


def _values(snap: dict) -> dict[str, float]:
    return {m.name: m.samples[0].value for m in _adaptive({"spec_adaptive": snap})}


def test_adaptive_gauges_are_always_exported() -> None:
    snap = {"enabled": True, "choice": "4/2/8", "predicted_tok_s": None,
            "measured_tok_s": None, "switches": 0}
    values = _values(snap)
    assert math.isnan(values["tpserve_spec_adaptive_predicted_tok_s"])
    assert math.isnan(values["tpserve_spec_adaptive_measured_tok_s"])
    values = _values({**snap, "predicted_tok_s": 410.5, "measured_tok_s": 398.0})
    assert values["tpserve_spec_adaptive_predicted_tok_s"] == 410.5
    assert values["tpserve_spec_adaptive_measured_tok_s"] == 398.0
    assert values["tpserve_spec_adaptive_enabled"] == 1.0
    assert list(_adaptive({})) == []  # no chooser: no gauges
