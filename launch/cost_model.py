"""The A/B harness's cost model: the same one the engine's adaptive speculation uses live
(``tpserve/spec/cost_model.py``), re-exported so the harness and the engine cannot drift."""

from tpserve.spec.cost_model import CostModel, Measurement, conditional, fit

__all__ = ["CostModel", "Measurement", "conditional", "fit"]
