"""``python -m hybridrec.plan``: calibrate this machine, or predict a cluster's step time.

    python -m hybridrec.plan --calibrate --out costs.json          # once per machine
    python -m hybridrec.plan --costs costs.json --tables 26 --rows 10000000 --dim 64 \\
        --bottom-mlp 64 64 --workers 64 --servers 8 --batch-per-worker 2048 \\
        --bandwidth-gbps 25 --latency-us 10 --png plan.png
    python -m hybridrec.plan --costs costs.json --workers 4 \\
        --dlrm="--data synthetic --batch-size 2048 --ps mpi:2 --cache-fraction 0.1"

Prints the predicted step time and samples/s with its breakdown for every W of
``--sweep-workers`` and every network (the given one and ``--sweep-bandwidth``), then
a recommendation (servers, cache fraction, placement) for ``--workers`` on the given
network. ``--json`` prints one JSON object instead; ``--png`` writes the plot.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from hybridrec.cli.errors import reported_errors
from hybridrec.cli.options import parse_config, program_name
from hybridrec.plan.calibrate import calibrate
from hybridrec.plan.costs import load_costs, save_costs
from hybridrec.plan.idlaw import TrafficModel
from hybridrec.plan.model import Prediction, predict
from hybridrec.plan.options import PlanOptions, plan_of
from hybridrec.plan.recommend import recommend
from hybridrec.plan.report import plot, table
from hybridrec.plan.spec import NetworkPlan, Plan


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def sweep(plan: Plan, costs: Any, traffic: TrafficModel, o: PlanOptions) -> list[Prediction]:
    """Predictions for every W of the sweep and every network (the plan's first)."""
    networks = [plan.network] + [
        NetworkPlan(bandwidth_gbps=b, latency_us=plan.network.latency_us)
        for b in o.sweep_bandwidth
        if b != plan.network.bandwidth_gbps
    ]
    out = []
    for net in networks:
        for w in o.sweep_workers:
            p = plan.with_(workers=w, network=net)
            out.append(predict(p, costs, traffic.traffic(p)))
    return out


def run(o: PlanOptions) -> dict[str, Any]:
    """What the command prints (as JSON with ``--json``)."""
    if o.calibrate:
        costs = calibrate(quick=o.quick, mpi=o.mpi, optimizers=o.optimizers or None, say=_say)
        path = save_costs(costs, o.out)
        return {"calibrated": str(path)}
    if o.costs is None:
        raise ValueError(
            "no costs: give --costs costs.json (make one on this machine with "
            "python -m hybridrec.plan --calibrate --out costs.json)"
        )
    costs = load_costs(o.costs)
    plan = plan_of(o)
    traffic = TrafficModel()
    mine = predict(plan, costs, traffic.traffic(plan))
    predictions = sweep(plan, costs, traffic, o)
    result: dict[str, Any] = {
        "plan": dataclasses.asdict(plan),
        "prediction": mine.to_json(),
        "sweep": [p.to_json() for p in predictions],
        "text": table(predictions),
    }
    if o.recommend:
        rec = recommend(plan, costs, traffic, worker_memory_gb=o.worker_memory_gb)
        result["recommendation"] = rec.to_json()
    if o.png:
        title = f"{len(plan.model.tables)} tables, batch {plan.cluster.batch_per_worker}/worker"
        result["png"] = str(plot(predictions, o.png, title=title))
    return result


def show(result: dict[str, Any]) -> None:
    if "calibrated" in result:
        print(f"costs written to {result['calibrated']}")
        return
    p = result["prediction"]
    print(
        f"this plan: W={p['workers']} S={p['servers']} on {p['network']}: step "
        f"{p['step_s'] * 1e3:.2f} ms, {p['samples_per_s']:,.0f} samples/s, bottleneck "
        f"{p['bottleneck']}"
    )
    print(result["text"])
    if "recommendation" in result:
        print(f"recommendation: {result['recommendation']['reason']}")
    if "png" in result:
        print(f"plot: {result['png']}")


@reported_errors()
def main(argv: list[str] | None = None) -> None:
    with program_name("python -m hybridrec.plan"):
        o = parse_config(PlanOptions, argv, __doc__.split("\n")[0])
    result = run(o)
    if o.json:
        result.pop("text", None)
        print(json.dumps(result))
    else:
        show(result)


if __name__ == "__main__":
    main()
