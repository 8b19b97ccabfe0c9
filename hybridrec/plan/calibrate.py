"""Measure this machine's costs for the planner (``python -m hybridrec.plan --calibrate``).

Each cost is timed at a few sizes (median of repeats after a warm-up, the statistic
the validation takes of the job's steps) and fitted by least squares to an affine
law (:mod:`hybridrec.plan.costs`), one torch thread per process:

* data: :func:`hybridrec.datasets.gather_batch` of a synthetic Criteo-shaped set
  (26 sparse + 13 dense features) at two batch sizes;
* dense: :class:`dense.DLRMDense` forward + backward + Adam step, two model widths at
  two batch sizes (per step, per parameter, per FLOP);
* server: one PS shard's work (:class:`ps.InProcessStore`, the engine each MPI server
  runs) through ``pull_many`` / ``push_many``: plain pulls, conditional pulls that
  return nothing, pushes per optimizer; fixed tables (what one server holds, and what
  each of several holds of its rows) and dynamic tables, per table request and per row;
* the DLRM job itself on one process (:func:`hybridrec.dlrm.measure.step_seconds`): its
  steady-state step with local, hybrid (in-process store) and cached placement at
  several batch sizes (and cache sizes); what remains after the parts above is the
  job's own embedding work (per step, per id looked up, per distinct id) and the
  cache's (per table step, per distinct id, per row fetched), as its tables' sole
  writer and with ``--other-writers`` (as every cache of several workers runs); all
  with the sparse pipeline off, and one cached run again with it on: the share of the
  modelled overlap it achieved is ``pipeline_overlap``;
* MPI (unless ``mpi=False``): ``mpirun -n 2`` of :mod:`hybridrec.plan.mpi_probe`: the
  MPI store's ``pull_many`` / ``push_many`` with one server: the server's own busy time
  per message (``server["mpi"]``: it serves a batch of fixed tables whole in C, not
  through the in-process shard's per-table path), and the rest is the wire cost;
  messages counted by ``request_counts``), and with two
  (``mpirun -n 3``: the wire cost with several servers; on fewer than 3 cores the
  model's P / C slowdown is taken out), allreduce, alltoallv and allgatherv at 2
  ranks, and 26 sharded tables at 2 ranks (without MPI: a sharded collection on one
  rank, which exchanges nothing).

``quick`` uses fewer sizes and repeats (about 15 s instead of 40).

This module runs the parts in that order and assembles :class:`Costs`; the parts are
:mod:`~hybridrec.plan.calibrate_compute` (data, dense, embedding collections),
:mod:`~hybridrec.plan.calibrate_store` (server), :mod:`~hybridrec.plan.calibrate_job`
(the job) and :mod:`~hybridrec.plan.calibrate_mpi` (MPI), measured with
:mod:`hybridrec.plan.timing`.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable

import torch

from hybridrec.plan.calibrate_compute import calibrate_data, calibrate_dense, calibrate_embedding
from hybridrec.plan.calibrate_job import calibrate_job
from hybridrec.plan.calibrate_mpi import (
    collective_costs,
    mpi_server_costs,
    run_mpi_probe,
    sharded_costs,
    sync_delay_of,
    wire_costs,
)
from hybridrec.plan.calibrate_store import calibrate_server, make_optimizer
from hybridrec.plan.costs import Costs
from hybridrec.plan.timing import DIM

__all__ = ["OPTIMIZERS", "calibrate"]

OPTIMIZERS = ("rowwise_adagrad", "sgd", "adagrad", "adam")


def calibrate(
    *,
    quick: bool = False,
    mpi: bool = True,
    optimizers: list[str] | None = None,
    say: Callable[[str], None] = lambda s: None,
) -> Costs:
    """Measure every cost of :class:`Costs` on this machine (see the module docstring)."""
    optimizers = list(optimizers or OPTIMIZERS)
    for o in optimizers:
        make_optimizer(o)
    if "rowwise_adagrad" not in optimizers:
        optimizers.insert(0, "rowwise_adagrad")  # the embedding and MPI parts use it
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        say("calibrating: batch assembly")
        data = calibrate_data(quick)
        say("calibrating: dense model")
        dense = calibrate_dense(quick)
        say("calibrating: PS shard (pull, conditional pull, push per optimizer)")
        server = calibrate_server(quick, optimizers)
        say("calibrating: embedding collections (sharded, one rank)")
        embedding = calibrate_embedding(quick, server, ("sharded",))
        say("calibrating: the DLRM job's steps (local, hybrid, cached; one process)")
        job_embedding, cache_costs, cache_shared, overlap = calibrate_job(
            quick, data, dense, server
        )
        embedding.update(job_embedding)
        probe = probe3 = None
        if mpi:
            say("calibrating: MPI store and collectives (mpirun -n 2)")
            probe = run_mpi_probe(quick)
            say("calibrating: MPI store with two servers (mpirun -n 3)")
            probe3 = run_mpi_probe(quick, ranks=3)
        say(f"calibration took {time.perf_counter() - t0:.1f} s")
    finally:
        torch.set_num_threads(threads)
    if probe is not None:
        server["mpi"] = mpi_server_costs(probe)
    collectives = collective_costs(probe)
    sync_delay = 0.0 if probe3 is None else sync_delay_of(probe3, collectives)
    if probe is not None:  # the exchange path only runs with 2 ranks or more
        embedding["sharded"] = sharded_costs(probe, collectives)
    return Costs(
        device="cpu",
        machine={
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "quick": quick,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },  # fmt: skip
        dim=DIM,
        data=data,
        dense=dense,
        embedding=embedding,
        cache=cache_costs,
        cache_shared=cache_shared,
        server=server,
        mpi_wire=None if probe is None else wire_costs(probe),
        mpi_wire_sharded=None
        if probe3 is None
        else wire_costs(probe3, max(1.0, 3 / (os.cpu_count() or 1))),
        collectives=collectives,
        sync_delay_s=sync_delay,
        pipeline_overlap=overlap,
    )
