"""Predicted step time of one synchronous training step, with its breakdown.

A step of one worker, in order (``docs/planner.md`` has the full model)::

    compute    = data(b) + dense(b) + own embedding work (+ the cache's bookkeeping)
    pull       = wire(messages, rows) + one server's service of this worker's pull
    push       = wire(messages, rows) + one server's service of this worker's push
    queueing   = (W - 1) x (pull + push service): W workers' requests reach each
                 single-threaded server at about the same time (the step is
                 synchronous), so the last one served waits for the other W - 1
    allreduce  = alpha * ceil(log2 W) + beta * 2 (W - 1) / W * dense bytes
    alltoallv  = 4 exchanges (counts, ids, rows back, gradients) of sharded tables:
                 alpha * (W - 1) + beta * bytes sent; replicated (local) tables
                 allgather their row gradients instead
    pipelined  = with the sparse pipeline and a free core per worker: minus the shorter
                 of the sparse step (pull + push + queueing + the cache's work) and the
                 rest of compute, which run at once on two threads, times the share
                 of it the calibration saw hidden (pipeline_overlap: both threads'
                 Python takes turns on the interpreter lock)
    step       = the sum; with P processes on C shared cores (P > C) every process
                 runs at C / P speed (waiting ranks and idle servers spin), and each
                 round of a collective and each request phase to the servers (pull,
                 push) waits for a descheduled process (sync_delay_s)

A server's service is ``alpha * table requests + beta * rows`` of its shard's store
(a fixed table, whether one server holds it or several split it; for the MPI store's
batches, which a server serves whole in C, its own measured busy time), and the MPI
store's wire cost is ``alpha * messages + tau * table requests + beta * rows`` on the
worker; messages per
server per phase are 1 with the batched protocol, else one per table. Rows per
server are the worker's rows / S. With a network, every phase adds a round trip's
latency and bytes / bandwidth at the worker's link, and a server's service is at
least its link's time for the bytes it receives. A row or gradient on the store's
wire is ``E x dim + 8`` bytes (``E`` = 4 for fp32 rows, 2 for fp16 and bf16: the
wire's per-row cost is scaled to that width); a sharded table's rows travel as
stored too, its gradients in float32, and the gradients local tables and per-rank
store replicas allgather are float32 whatever the table's type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hybridrec.plan.costs import Costs, Linear
from hybridrec.plan.idlaw import TableTraffic
from hybridrec.plan.spec import Plan, TablePlan

PARTS = ("compute", "pull", "push", "server_queueing", "allreduce", "alltoallv", "pipelined")


@dataclass(slots=True)
class Prediction:
    """``parts`` seconds per step by :data:`PARTS` (plus ``shared_cores``, the time
    added by processes sharing cores); ``step_s`` their sum."""

    workers: int
    servers: int
    network: str
    parts: dict[str, float]
    step_s: float
    samples_per_s: float
    bottleneck: str
    hit_rate: float | None = None
    rows_per_step: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {
            "workers": self.workers, "servers": self.servers, "network": self.network,
            "step_s": self.step_s, "samples_per_s": self.samples_per_s,
            "bottleneck": self.bottleneck, "parts": self.parts, "hit_rate": self.hit_rate,
            "rows_per_step": self.rows_per_step,
        }  # fmt: skip


def _log2(w: int) -> int:
    return math.ceil(math.log2(w)) if w > 1 else 0


@dataclass(slots=True)
class _Phase:
    """One request phase (pull or push) of one worker: wire on the worker, service on
    each server (one server's share), bytes on the worker's link."""

    wire: float = 0.0
    service: float = 0.0
    bytes: float = 0.0


def batched(plan: Plan, costs: Costs) -> bool:
    """Whether a step sends each server one message per phase for all tables."""
    if plan.cluster.protocol != "auto":
        return plan.cluster.protocol == "batched"
    wire = costs.mpi_wire
    return wire is not None and wire.messages_per_batch <= 1.0


def _store_phases(
    plan: Plan, costs: Costs, tables: list[TablePlan], traffic: dict[str, TableTraffic]
) -> tuple[_Phase, _Phase]:
    """The pull and push phases of the hybrid tables (one worker's step). The pull
    phase holds the plain pulls (every distinct id, or a cache's misses) and a cache's
    conditional pull (every id asked with its copy's clock, stale copies returned)."""
    c = plan.cluster
    mpi = c.store == "mpi"
    servers = c.servers if mpi else 1
    # Fixed tables: one server holds the table, several hold the rows routed to them,
    # densely too (ps.mpi.fixed_shard), so both cost what a fixed table does.
    shard = costs.server["dense"]
    wire = costs.mpi_wire
    pulls, push_costs = shard, {t.name: shard for t in tables}
    narrow = any(t.dtype != "fp32" for t in tables)
    if mpi and "mpi" in costs.server and batched(plan, costs) and not narrow:
        # an MPI server serves a batch of fixed tables of float32 rows whole in C
        # (ps.mpi.batched_pass): its pulls always, its pushes when every table's optimizer
        # is row-wise Adagrad; a batch with a narrow table's part goes the Python path,
        # part by part (whose updates round stochastically), as one shard's calibration
        pulls = costs.server["mpi"]
        if all(t.optimizer == "rowwise_adagrad" for t in tables):
            push_costs = {t.name: costs.server["mpi"] for t in tables}
    # Measured with two servers; only on a calibration machine of 3 cores or more is that
    # the servers' wire: on fewer, the 3 processes' scheduler waits swamp it (0.4 ms per
    # table part against 0.04-0.09 with one server, measured on 2 cores), and the model
    # charges those waits itself (a sync delay per request phase).
    own_cores = int(costs.machine.get("cpus") or 1) >= 3
    if servers > 1 and costs.mpi_wire_sharded is not None and own_cores:
        wire = costs.mpi_wire_sharded
    if mpi and wire is None:
        raise ValueError(
            "costs: this calibration has no MPI store costs (made with --no-mpi); "
            "calibrate with MPI or plan with --store inprocess"
        )
    pull, push = _Phase(), _Phase()
    returned_extra = max(0.0, pulls.pull.beta_s - pulls.pull_check.beta_s)
    for t in tables:
        tr = traffic[t.name]
        rs = costs.row_scale(t.dim)
        pull.service += pulls.pull(tr.pull_requests, rs * tr.pulled / servers)
        pull.service += pulls.pull_check(tr.check_requests, rs * tr.asked / servers)
        pull.service += returned_extra * rs * tr.refreshed / servers
        push.service += push_costs[t.name].push_of(t.optimizer)(
            tr.push_requests, rs * tr.pushed / servers
        )
        # a row or a gradient and 8 bytes (its id or clock) on the wire; fp16 and bf16
        # rows and gradients travel as 2 bytes per element
        row = t.element_bytes * t.dim
        pull.bytes += (row + 8) * tr.pulled + 16 * tr.asked + row * tr.refreshed
        push.bytes += (row + 8) * tr.pushed
        if wire is not None and mpi:  # per-row wire costs scale with the row's bytes
            ws = costs.row_scale(t.dim * t.element_bytes // 4)
            pull.wire += ws * (wire.pull.beta_s * tr.returned + wire.pull_check.beta_s * tr.asked)
            push.wire += ws * wire.push.beta_s * tr.pushed
    if wire is not None and mpi:
        kinds = [traffic[t.name] for t in tables]
        if batched(plan, costs):  # one message per server per kind of request
            plain = max(tr.pull_requests for tr in kinds)
            checks = max(tr.check_requests for tr in kinds)
            pushes = max(tr.push_requests for tr in kinds)
        else:
            plain = sum(tr.pull_requests for tr in kinds)
            checks = sum(tr.check_requests for tr in kinds)
            pushes = sum(tr.push_requests for tr in kinds)
        pull.wire += (wire.pull.alpha_s * plain + wire.pull_check.alpha_s * checks) * servers
        push.wire += wire.push.alpha_s * pushes * servers
        per_table = wire.per_table_s
        pull.wire += sum(
            per_table["pull"] * tr.pull_requests + per_table["pull_check"] * tr.check_requests
            for tr in kinds
        )
        push.wire += per_table["push"] * sum(tr.push_requests for tr in kinds)
    return pull, push


def _network(plan: Plan, phase: _Phase, round_trips: float) -> tuple[float, float]:
    """(seconds on the worker's link for ``phase``, a server's link time per worker)."""
    net = plan.network
    if net.bandwidth_gbps is None:
        return 0.0, 0.0
    per_byte = 8.0 / (net.bandwidth_gbps * 1e9)
    latency = 2 * net.latency_us * 1e-6 * round_trips
    servers = max(plan.cluster.servers, 1)
    return latency + phase.bytes * per_byte, phase.bytes / servers * per_byte


def _collective(
    costs: Costs, plan: Plan, name: str, calls: float, count: float, bytes_: float
) -> float:
    """``calls`` x alpha x ``count`` + beta x ``bytes_`` of collective ``name`` (with the
    network's latency and bandwidth when given, whichever is slower)."""
    c: Linear = costs.collectives[name]
    alpha, beta = c.alpha_s, c.beta_s
    net = plan.network
    if net.bandwidth_gbps is not None:
        alpha += net.latency_us * 1e-6
        beta = max(beta, 8.0 / (net.bandwidth_gbps * 1e9))
    return alpha * calls * count + beta * bytes_


def predict(plan: Plan, costs: Costs, traffic: dict[str, TableTraffic]) -> Prediction:
    """The step time of ``plan`` with ``costs`` and the sampled ``traffic`` per table."""
    if plan.device.kind != costs.device:
        raise ValueError(
            f"the plan's device is {plan.device.kind!r} but the costs were calibrated on "
            f"{costs.device!r}; calibrate on a {plan.device.kind} machine"
        )
    model, c = plan.model, plan.cluster
    w, b = c.workers, c.batch_per_worker
    parts = dict.fromkeys(PARTS, 0.0)
    rows: dict[str, float] = {}

    # ---- compute: batch assembly, dense forward + backward + optimizer, own embedding work
    parts["compute"] += costs.data(1, b)
    d = costs.dense
    parts["compute"] += d.alpha_s + d.s_per_param * model.dense_params
    parts["compute"] += d.s_per_flop * model.dense_flops_per_sample * b
    for placement in ("local", "hybrid", "sharded"):
        tables = model.placed(placement)
        if not tables:
            continue
        e = costs.embedding[placement]
        parts["compute"] += e.alpha_s
        for t in tables:
            tr = traffic[t.name]
            rs = costs.row_scale(t.dim)
            parts["compute"] += rs * (e.per_lookup_s * tr.lookups + e.per_unique_s * tr.unique)
            if placement == "local" and w > 1:  # every replica applies all W gradients
                parts["compute"] += rs * e.per_unique_s * tr.unique * (w - 1)

    # ---- hybrid tables: the store (and the cache in front of it)
    hybrid = model.placed("hybrid")
    hit_rate = None
    cache_work = 0.0
    if hybrid:
        pull, push = _store_phases(plan, costs, hybrid, traffic)
        cached = [traffic[t.name] for t in hybrid if traffic[t.name].check_requests > 0]
        if cached:
            k = costs.cache if plan.cache.sole_writer(w) else costs.cache_shared
            cache_work = k.work(cached)
            parts["compute"] += cache_work
            lookups = sum(tr.unique for tr in cached)
            hit_rate = sum(tr.hit_rate * tr.unique for tr in cached) / max(lookups, 1e-12)
        pull_net, pull_link = _network(plan, pull, 1.0)
        push_net, push_link = _network(plan, push, 1.0)
        pull_service = max(pull.service, pull_link)
        push_service = max(push.service, push_link)
        parts["pull"] = pull.wire + pull_service + pull_net
        parts["push"] = push.wire + push_service + push_net
        if c.store == "mpi":
            parts["server_queueing"] = (w - 1) * (pull_service + push_service)
        elif w > 1:  # an in-process store per rank: gradients are allgathered
            grad_bytes = sum((4 * t.dim + 8) * traffic[t.name].pushed for t in hybrid)
            parts["alltoallv"] += _collective(
                costs, plan, "allgatherv", 2, _log2(w), grad_bytes * (w - 1)
            )
        rows["pulled"] = sum(traffic[t.name].returned for t in hybrid)
        rows["asked"] = sum(traffic[t.name].asked for t in hybrid)
        rows["pushed"] = sum(traffic[t.name].pushed for t in hybrid)

    # ---- collectives: dense allreduce, sharded exchanges, replicated-table gradients
    if w > 1:
        dense_bytes = 4.0 * model.dense_params
        parts["allreduce"] = _collective(
            costs, plan, "allreduce", 1, _log2(w), dense_bytes * 2 * (w - 1) / w
        )
        sharded = model.placed("sharded")
        if sharded:
            off = (w - 1) / w  # the share of a worker's ids owned by other ranks
            # per id owned elsewhere: the id, its row back (as stored: 2 bytes per
            # element for fp16 and bf16) and its float32 gradient
            sent = sum(
                off * traffic[t.name].unique * (8 + (t.element_bytes + 4) * t.dim)
                + 8 * len(sharded)
                for t in sharded
            )
            parts["alltoallv"] += _collective(costs, plan, "alltoallv", 4, w - 1, sent)
        local = model.placed("local")
        if local:
            grad_bytes = sum((4 * t.dim + 8) * traffic[t.name].unique for t in local)
            parts["alltoallv"] += _collective(
                costs, plan, "allgatherv", 2, _log2(w), grad_bytes * (w - 1)
            )

    procs = w + (c.servers if c.store == "mpi" and hybrid else 0)
    cores = plan.device.shared_cores
    shared_store = c.store == "mpi" or w == 1  # per-rank in-process stores: no pipeline
    if c.sparse_pipeline and hybrid and shared_store and (cores is None or procs + w <= cores):
        # a second thread per worker, on a core of its own, runs the sparse step (the
        # next batch's pull and install, this batch's push, the waits on the servers and
        # the cache's work) while the dense step runs: the shorter of the two is hidden
        sparse = parts["pull"] + parts["push"] + parts["server_queueing"] + cache_work
        parts["pipelined"] = -costs.pipeline_overlap * min(sparse, parts["compute"] - cache_work)
    path = sum(parts.values())
    shared = 0.0
    if cores is not None and procs > cores:
        shared = path * (procs / cores - 1)
        # every round of a collective waits for a rank the scheduler put aside
        rounds = _log2(w) if w > 1 else 0  # the dense allreduce
        rounds += 4 * (w - 1) if model.placed("sharded") and w > 1 else 0
        rounds += 2 * _log2(w) if model.placed("local") and w > 1 else 0
        # and so does each request phase to the servers (the pull, the push)
        rounds += 2 if hybrid and c.store == "mpi" else 0
        shared += costs.sync_delay_s * rounds
    step = path + shared
    named = dict(parts)
    named["shared_cores"] = shared
    bottleneck = max(named, key=lambda k: named[k])
    return Prediction(
        workers=w, servers=c.servers if c.store == "mpi" else 0, network=plan.network.label,
        parts=named, step_s=step, samples_per_s=w * b / step, bottleneck=bottleneck,
        hit_rate=hit_rate, rows_per_step=rows,
    )  # fmt: skip
