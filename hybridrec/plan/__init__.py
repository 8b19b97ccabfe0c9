"""Capacity planner: predicted step time of a hybridrec job past this machine.

``python -m hybridrec.plan --calibrate --out costs.json`` measures this machine's costs
(:mod:`hybridrec.plan.calibrate`); ``python -m hybridrec.plan --costs costs.json ...``
predicts the step time and its breakdown for a model, an id law and a cluster
(:mod:`hybridrec.plan.model`), over a range of workers and network speeds, and
recommends servers, cache size and placement (:mod:`hybridrec.plan.recommend`).
The model and its limits: ``docs/planner.md``.
"""

from hybridrec.plan.costs import Costs, load_costs, save_costs
from hybridrec.plan.spec import (
    CachePlan,
    ClusterPlan,
    DevicePlan,
    IdLaw,
    ModelPlan,
    NetworkPlan,
    Plan,
    TablePlan,
)

__all__ = [
    "CachePlan",
    "ClusterPlan",
    "Costs",
    "DevicePlan",
    "IdLaw",
    "ModelPlan",
    "NetworkPlan",
    "Plan",
    "TablePlan",
    "load_costs",
    "save_costs",
]
