"""Servers, cache size and placement for the user's W and network: a search on the model.

Every combination of placement (hybrid, sharded, and local when the tables fit a
worker's memory), server count (powers of two up to W, hybrid only) and cache fraction
(hybrid only) is predicted; the recommendation is the fastest, except that fewer
servers are preferred while they stay within ``tolerance`` of the best (a server is a
machine to pay for). The reason names the bottleneck and what the runner-up loses.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hybridrec.plan.costs import Costs
from hybridrec.plan.idlaw import TrafficModel
from hybridrec.plan.model import Prediction, predict
from hybridrec.plan.spec import CachePlan, Plan

CACHE_FRACTIONS = (0.0, 0.01, 0.05, 0.1, 0.2)


@dataclass(slots=True)
class Choice:
    placement: str
    servers: int
    cache_fraction: float
    prediction: Prediction

    def label(self) -> str:
        if self.placement != "hybrid":
            return f"{self.placement} placement"
        cache = f"cache {self.cache_fraction:.0%}" if self.cache_fraction else "no cache"
        return f"hybrid placement, {self.servers} server(s), {cache}"

    def to_json(self) -> dict[str, object]:
        return {
            "placement": self.placement, "servers": self.servers,
            "cache_fraction": self.cache_fraction, "prediction": self.prediction.to_json(),
        }  # fmt: skip


@dataclass(slots=True)
class Recommendation:
    best: Choice
    candidates: list[Choice]
    reason: str

    def to_json(self) -> dict[str, object]:
        return {
            "best": self.best.to_json(), "reason": self.reason,
            "candidates": [c.to_json() for c in self.candidates],
        }  # fmt: skip


def table_bytes(plan: Plan) -> float:
    """Bytes of every table's rows as stored (``TablePlan.row_bytes``: weights of the
    table's type, its optimizer's float32 state, a clock)."""
    return float(sum(t.rows * t.row_bytes for t in plan.model.tables))


def recommend(
    plan: Plan,
    costs: Costs,
    traffic: TrafficModel,
    *,
    worker_memory_gb: float = 64.0,
    tolerance: float = 0.05,
) -> Recommendation:
    w = plan.cluster.workers
    candidates: list[Choice] = []
    servers = [s for s in (2**k for k in range(11)) if s <= max(w, 1)]
    for placement in ("hybrid", "sharded", "local"):
        if placement == "local" and table_bytes(plan) > worker_memory_gb * 2**30:
            continue
        if placement == "sharded" and w == 1:
            continue  # nothing to shard over
        model = plan.model.with_placement(placement)
        if placement != "hybrid":
            p = plan.with_(model=model, cache=CachePlan(), store="mpi", servers=1)
            candidates.append(Choice(placement, 0, 0.0, predict(p, costs, traffic.traffic(p))))
            continue
        for s in servers:
            for f in CACHE_FRACTIONS:
                cache = dataclasses.replace(plan.cache, fraction=f, rows=0)
                p = plan.with_(model=model, cache=cache, store="mpi", servers=s)
                candidates.append(Choice(placement, s, f, predict(p, costs, traffic.traffic(p))))
    fastest = max(c.prediction.samples_per_s for c in candidates)
    good = [c for c in candidates if c.prediction.samples_per_s >= (1 - tolerance) * fastest]
    best = min(good, key=lambda c: (c.servers, -c.prediction.samples_per_s))
    others = sorted(
        (c for c in candidates if c.placement != best.placement or c.servers != best.servers),
        key=lambda c: -c.prediction.samples_per_s,
    )
    bp = best.prediction
    reason = (
        f"{best.label()}: {bp.samples_per_s:,.0f} samples/s predicted at W={w} on "
        f"{plan.network.label}, step {bp.step_s * 1e3:.2f} ms, bottleneck {bp.bottleneck} "
        f"({bp.parts[bp.bottleneck] * 1e3:.2f} ms)"
    )
    if others:
        o = others[0]
        reason += (
            f"; next best: {o.label()} at {o.prediction.samples_per_s:,.0f} samples/s "
            f"(bottleneck {o.prediction.bottleneck})"
        )
    hybrid = [c for c in candidates if c.placement == "hybrid"]
    h = max(hybrid, key=lambda c: c.prediction.samples_per_s) if hybrid else None
    if best.placement != "hybrid" and h is not None and (not others or h is not others[0]):
        reason += (
            f"; the best PS setup is {h.label()} at {h.prediction.samples_per_s:,.0f} "
            f"samples/s (bottleneck {h.prediction.bottleneck})"
        )
    return Recommendation(best=best, candidates=candidates, reason=reason)
