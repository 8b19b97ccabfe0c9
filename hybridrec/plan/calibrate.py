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
* the DLRM job itself on one process (:func:`job_step_seconds`): its steady-state step
  with local, hybrid (in-process store) and cached placement at several batch sizes
  (and cache sizes); what remains after the parts above is the job's own embedding
  work (per step, per id looked up, per distinct id) and the cache's (per table step,
  per distinct id, per row fetched);
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
"""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridrec.plan.costs import (
    CacheCosts,
    Costs,
    DenseCosts,
    EmbeddingCosts,
    Linear,
    StoreCosts,
    WireCosts,
)

DIM = 16  # row width every per-row cost is timed at
OPTIMIZERS = ("rowwise_adagrad", "sgd", "adagrad", "adam")


def timed(fn: Callable[[], object], reps: int, warm: int = 2, quantile: float = 0.5) -> float:
    """Seconds of ``fn()``: the median (``quantile``) of ``reps`` calls after ``warm``.

    The median is the statistic the validation takes of the job's steps. Operations
    between processes (a PS round trip, a collective) are timed at the lower quartile
    instead (:mod:`hybridrec.plan.mpi_probe`): each waits for another process to be
    scheduled, and on a machine shared with other work their median can be that wait,
    many times the cost, for a whole calibration."""
    for _ in range(warm):
        fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return float(np.quantile(out, quantile))


def fit(rows: list[list[float]], times: list[float]) -> list[float]:
    """Least-squares coefficients (clipped at 0) of ``times ~ rows @ coef``."""
    a = np.asarray(rows, dtype=np.float64)
    y = np.asarray(times, dtype=np.float64)
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    if (coef < 0).any():  # refit without the negative terms (a cost is never negative)
        keep = coef >= 0
        coef = np.zeros_like(coef)
        if keep.any():
            sub, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
            coef[keep] = np.maximum(sub, 0.0)
    return [float(c) for c in coef]


def fit_linear(points: list[tuple[float, float, float]]) -> Linear:
    """``(count, amount, seconds)`` points -> :class:`Linear`."""
    alpha, beta = fit([[c, a] for c, a, _ in points], [s for _, _, s in points])
    return Linear(alpha_s=alpha, beta_s=beta)


def make_optimizer(kind: str, lr: float = 0.01) -> Any:
    import ps

    classes = {"sgd": ps.SGD, "rowwise_adagrad": ps.RowWiseAdagrad, "adagrad": ps.Adagrad,
               "adam": ps.Adam}  # fmt: skip
    if kind not in classes:
        raise ValueError(f"optimizer {kind!r}: expected one of {sorted(classes)}")
    return classes[kind](lr=lr)


# ---------------------------------------------------------------- data and dense


def calibrate_data(quick: bool) -> Linear:
    from hybridrec.datasets import gather_batch, make_synthetic

    data = make_synthetic(num_samples=4096, num_rows=1000, seed=0)
    gen = torch.Generator().manual_seed(0)
    points = []
    for b in (64, 1024):
        idx = torch.randint(0, data.num_samples, (b,), generator=gen)
        s = timed(functools.partial(gather_batch, data, idx), 5 if quick else 20)
        points.append((1.0, float(b), s))
    return fit_linear(points)


def dense_work(config: Any) -> tuple[float, int]:
    """``(forward + backward FLOPs per sample, parameters)`` of a ``dense.DLRMConfig``:
    every weight matrix costs 2 FLOPs per entry forward and 4 backward; the dot
    interaction ``(F+1)^2 D`` multiply-adds forward and twice that backward."""
    from dense import DLRMDense

    model = DLRMDense(config)
    params = sum(p.numel() for p in model.parameters())
    matrix = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    flops = 6.0 * matrix
    if config.interaction == "dot":
        n = config.num_sparse + 1
        flops += 6.0 * n * n * config.embedding_dim
    return flops, int(params)


def calibrate_dense(quick: bool) -> DenseCosts:
    from dense import DLRMConfig, DLRMDense

    rows, times = [], []
    for width in (64, 512):
        cfg = DLRMConfig(num_dense=13, num_sparse=26, embedding_dim=DIM,
                         bottom_mlp=[width, DIM], top_mlp=[width, width // 2, 1])  # fmt: skip
        flops, params = dense_work(cfg)
        torch.manual_seed(0)
        model = DLRMDense(cfg)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for b in (64, 512):
            x = torch.randn(b, 13)
            embs = [torch.randn(b, DIM) for _ in range(26)]
            y = torch.rand(b)

            def step(model: Any = model, opt: Any = opt, x: Any = x, embs: Any = embs,
                     y: Any = y) -> None:  # fmt: skip
                loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x, embs), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

            rows.append([1.0, float(params), flops * b])
            times.append(timed(step, 5 if quick else 15))
    alpha, per_param, per_flop = fit(rows, times)
    return DenseCosts(alpha_s=alpha, s_per_param=per_param, s_per_flop=per_flop)


# ---------------------------------------------------------------- the PS shard


def make_tables(store: Any, prefix: str, k: int, rows: int | None, optimizer: str) -> list[str]:
    import ps

    names = [f"{prefix}{i}" for i in range(k)]
    for n in names:
        store.create_table(ps.TableSpec(name=n, num_rows=rows, dim=DIM,
                                        optimizer=make_optimizer(optimizer)))  # fmt: skip
    return names


def time_store(
    store: Any,
    by_optimizer: dict[str, list[str]],
    n: int,
    rows: int,
    reps: int,
    quantile: float = 0.5,
) -> dict[str, float]:
    """Seconds of one ``pull_many`` / conditional ``pull_many`` / ``push_many`` of ``n``
    distinct ids in each table of an optimizer (pulls: the first optimizer's tables)."""
    import ps

    gen = torch.Generator().manual_seed(n)
    ids = torch.randperm(rows, generator=gen)[:n].sort().values
    grads = torch.full((n, DIM), 1e-3)
    out: dict[str, float] = {}
    for opt, tabs in by_optimizer.items():
        push = [ps.PushRequest(table=t, ids=ids, grads=grads) for t in tabs]
        out[f"push:{opt}"] = timed(functools.partial(store.push_many, push), reps, 2, quantile)
    tabs = next(iter(by_optimizer.values()))
    pull = [ps.PullRequest(table=t, ids=ids) for t in tabs]
    out["pull"] = timed(lambda: store.pull_many(pull), reps, 2, quantile)
    clocks = [store.clocks(t, ids) for t in tabs]
    check = [ps.PullRequest(table=t, ids=ids, clocks=c, bound=0)
             for t, c in zip(tabs, clocks, strict=True)]  # fmt: skip
    out["pull_check"] = timed(lambda: store.pull_many(check), reps, 2, quantile)
    return out


def store_grid(quick: bool) -> list[tuple[int, int]]:
    """``(tables, rows per table)`` sizes the stores are timed at."""
    return [(1, 64), (8, 64), (8, 1024)] if quick else [(1, 64), (8, 64), (1, 2048), (8, 2048)]


def calibrate_server(quick: bool, optimizers: list[str]) -> dict[str, StoreCosts]:
    """Per table request and per row, on a fixed table ("dense": what one MPI server
    holds, and each of several of its rows) and on a dynamic table ("sparse")."""
    import ps

    rows = 20_000
    out = {}
    for layout, num_rows in (("dense", rows), ("sparse", None)):
        points: dict[str, list[tuple[float, float, float]]] = {}
        for k, n in store_grid(quick):
            store = ps.InProcessStore()
            by_opt = {o: make_tables(store, f"{o}_", k, num_rows, o) for o in optimizers}
            if num_rows is None:  # create the rows first: a shard holds rows it was pushed
                every = torch.arange(rows)
                store.push_many([ps.PushRequest(table=t, ids=every, grads=torch.zeros(rows, DIM))
                                 for names in by_opt.values() for t in names])  # fmt: skip
            got = time_store(store, by_opt, n, rows, 3 if quick else 9)
            for kind, s in got.items():
                points.setdefault(kind, []).append((float(k), float(k * n), s))
        out[layout] = StoreCosts(
            pull=fit_linear(points["pull"]),
            pull_check=fit_linear(points["pull_check"]),
            push={opt: fit_linear(points[f"push:{opt}"]) for opt in optimizers},
        )
    return out


def shard_seconds(
    shard: StoreCosts, optimizer: str, requests: float, pulled: float, pushed: float
) -> float:
    """The shard's work for ``requests`` pulls and pushes of ``pulled`` / ``pushed`` rows."""
    return shard.pull(requests, pulled) + shard.push_of(optimizer)(requests, pushed)


# ---------------------------------------------------------------- embedding and cache


def ids_of(rng: np.random.Generator, law: str, rows: int, n: int) -> np.ndarray:
    if law == "uniform":
        return rng.integers(0, rows, n)
    from hybridrec.plan.idlaw import ZipfSampler

    return ZipfSampler(rows, 1.2).draw(rng, n)


def calibrate_embedding(
    quick: bool,
    server: dict[str, StoreCosts],
    placements: tuple[str, ...] = ("local", "hybrid", "sharded"),
) -> dict[str, EmbeddingCosts]:
    import comm
    import ps
    from embedding import EmbeddingCollection, KeyedJaggedIds, RowWiseAdagrad, TableConfig

    tables, rows = 8, 50_000
    group = comm.init("local")
    out = {}
    try:
        for placement in placements:
            design, times = [], []
            for b in (128, 1024):
                for law in ("uniform", "zipf"):
                    store = ps.InProcessStore()
                    cfgs = [
                        TableConfig(
                            name=f"t{i}", num_rows=rows, dim=DIM, feature_names=[f"t{i}"],
                            placement=placement,  # type: ignore[arg-type]
                            optimizer=RowWiseAdagrad(lr=0.01),
                        )
                        for i in range(tables)
                    ]  # fmt: skip
                    emb = EmbeddingCollection(cfgs, group=group, store=store)
                    rng = np.random.default_rng(b)
                    per = [ids_of(rng, law, rows, b) for _ in range(tables)]
                    unique = float(sum(np.unique(p).size for p in per))
                    kjt = KeyedJaggedIds(
                        [f"t{i}" for i in range(tables)],
                        torch.from_numpy(np.concatenate(per)),
                        torch.ones(tables * b, dtype=torch.int64),
                    )

                    def step(emb: Any = emb, kjt: Any = kjt) -> None:
                        pooled = emb(kjt)
                        sum(v.sum() for v in pooled.values()).backward()  # type: ignore[union-attr]

                    s = timed(step, 3 if quick else 9)
                    if placement == "hybrid":  # the store's share is the server's cost
                        s -= shard_seconds(server["dense"], "rowwise_adagrad", tables,
                                           unique, unique)  # fmt: skip
                    design.append([1.0, float(tables * b), unique])
                    times.append(max(s, 0.0))
            alpha, per_lookup, per_unique = fit(design, times)
            out[placement] = EmbeddingCosts(
                alpha_s=alpha, per_lookup_s=per_lookup, per_unique_s=per_unique
            )
    finally:
        group.close()
    return out


# ---------------------------------------------------------------- the job itself


JOB_ROWS = 20_000  # rows per table of the synthetic data the job steps are timed on


def store_share(shard: StoreCosts, t: Any) -> float:
    """One shard's work for one table's step of traffic ``t`` (a ``TableTraffic``)."""
    extra = max(0.0, shard.pull.beta_s - shard.pull_check.beta_s)
    own = shard.pull(t.pull_requests, t.pulled) + shard.pull_check(t.check_requests, t.asked)
    return own + extra * t.refreshed + shard.push_of("rowwise_adagrad")(t.push_requests, t.pushed)


def job_step_seconds(options: list[str], quick: bool) -> list[float]:
    """Steady-state step seconds (one per logged block) of the DLRM job
    (:mod:`hybridrec.dlrm.job`) in this process on 26 synthetic tables: the job's own
    loop, read from its metrics file as the validation reads a real run's."""
    import tempfile

    import comm
    import ps
    from hybridrec.dlrm.job import DLRMJob, parse_args

    steps, every, warm = (20, 4, 8) if quick else (30, 5, 10)
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        cfg = parse_args([
            "--data", "synthetic", "--synthetic-rows", str(JOB_ROWS), "--synthetic-samples",
            "50000", "--max-steps", str(steps), "--log-every", str(every), "--no-progress",
            "--no-verbose", "--metrics-out", str(metrics), *options,
        ])  # fmt: skip
        group = comm.init("local")
        try:
            job = DLRMJob(cfg, group, ps.InProcessStore())
            job.trainer.fit()
            job.trainer.close()
        finally:
            group.close()
        times = []
        for line in metrics.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            if row.get("kind") == "step" and row.get("step", 0) > warm and row["step"] % every == 0:
                times.append(cfg.batch_size / row["samples_per_s"])
    return times


def calibrate_job(
    quick: bool, data: Linear, dense: DenseCosts, server: dict[str, StoreCosts]
) -> tuple[dict[str, EmbeddingCosts], CacheCosts]:
    """The job's own embedding work (local and hybrid placement) and the cache's, from
    the DLRM job's steps on one process (an in-process store) at several batch sizes:
    what is left of a step after the batch assembly, the dense part and the store's
    share (the sampled traffic on the fitted shard costs) is fitted per step, per id
    looked up and per distinct id (the cache: per table step, per distinct id, per row
    fetched, beyond the uncached hybrid step)."""
    from hybridrec.dlrm.job import parse_args
    from hybridrec.plan.fromjob import plan_from_dlrm
    from hybridrec.plan.idlaw import TrafficModel

    def cache_opts(fraction: float) -> list[str]:
        return ["--cache-fraction", str(fraction), "--cache-policy", "lfu", "--read-bound", "4",
                "--write-bound", "4"]  # fmt: skip

    batches = (128, 1024) if quick else (128, 512, 1024)
    # the cached runs vary the cache size too, so that rows fetched and distinct ids
    # do not grow together (the fit tells them apart)
    cached_runs = [(128, 0.2), (1024, 0.02)] if quick else [(128, 0.2), (512, 0.02),
                                                             (1024, 0.2), (1024, 0.02)]  # fmt: skip
    shard = server["dense"]
    traffic = TrafficModel()
    emb: dict[str, EmbeddingCosts] = {}
    fits: dict[str, tuple[list[list[float]], list[float]]] = {}

    def options(variant: str, b: int, fraction: float) -> list[str]:
        opts = ["--batch-size", str(b), "--placement", "local" if variant == "local" else "hybrid"]
        return opts + (cache_opts(fraction) if fraction else [])

    configs = [("local", b, 0.0) for b in batches] + [("hybrid", b, 0.0) for b in batches]
    configs += [("cached", b, f) for b, f in cached_runs]
    # every configuration once per round, the rounds one after the other: a burst of
    # other work on the machine then slows one run of each, not all runs of one
    blocks: dict[tuple[str, int, float], list[float]] = {c: [] for c in configs}
    for _ in range(1 if quick else 2):
        for c in configs:
            blocks[c] += job_step_seconds(options(*c), quick)
    for variant in ("local", "hybrid", "cached"):
        placement = "local" if variant == "local" else "hybrid"
        runs = cached_runs if variant == "cached" else [(b, 0.0) for b in batches]
        for b, fraction in runs:
            opts = options(variant, b, fraction)
            step = float(np.median(blocks[(variant, b, fraction)]))
            plan = plan_from_dlrm(parse_args(["--data", "synthetic", "--synthetic-rows",
                                              str(JOB_ROWS), *opts]), workers=1)  # fmt: skip
            tr = traffic.traffic(plan)
            model = plan.model
            rest = step - data(1, b) - dense.alpha_s - dense.s_per_param * model.dense_params
            rest -= dense.s_per_flop * model.dense_flops_per_sample * b
            lookups = sum(t.lookups for t in tr.values())
            unique = sum(t.unique for t in tr.values())
            if placement == "hybrid":
                rest -= sum(store_share(shard, t) for t in tr.values())
            if variant == "cached":
                h = emb["hybrid"]
                rest -= h.alpha_s + h.per_lookup_s * lookups + h.per_unique_s * unique
                row = [float(len(tr)), unique, sum(t.returned for t in tr.values())]
            else:
                row = [1.0, lookups, unique]
            fits.setdefault(variant, ([], []))
            fits[variant][0].append(row)
            fits[variant][1].append(max(rest, 0.0))
        coef = fit(*fits[variant])
        if variant != "cached":
            emb[variant] = EmbeddingCosts(
                alpha_s=coef[0], per_lookup_s=coef[1], per_unique_s=coef[2]
            )
    per_table, per_id, per_admit = fit(*fits["cached"])
    return emb, CacheCosts(per_table_s=per_table, per_id_s=per_id, per_admit_s=per_admit)


# ---------------------------------------------------------------- MPI


def mpirun_path() -> str:
    """The ``mpirun`` beside this interpreter (the mpich wheel), else one on PATH."""
    here = Path(sys.executable).parent / "mpirun"
    if here.exists():
        return str(here)
    import shutil

    found = shutil.which("mpirun")
    if found is None:
        raise RuntimeError(
            "mpirun not found beside the interpreter or on PATH; install MPI (the test "
            "extra's mpich wheel) or calibrate with --no-mpi"
        )
    return found


def run_mpi_probe(quick: bool, ranks: int = 2, timeout_s: float = 600.0) -> dict[str, Any]:
    """``mpirun -n ranks`` of :mod:`hybridrec.plan.mpi_probe`; its JSON result."""
    root = Path(__file__).resolve().parents[2]
    cmd = [mpirun_path(), "-n", str(ranks), sys.executable, "-m", "hybridrec.plan.mpi_probe"]
    cmd += ["--quick"] if quick else []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(root), env.get("PYTHONPATH", "")] if p)
    out = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(
            f"MPI calibration failed (exit {out.returncode}): {' '.join(cmd)}\n"
            f"{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
        )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def mpi_server_costs(probe: dict[str, Any]) -> StoreCosts:
    """What an MPI server itself spends on one worker's batched request (its busy time
    per message, measured by the probe): per table request and per row of its share.
    A server serves a batch of fixed tables whole in C (``ps.mpi.batched_pass``), so
    this is not the in-process shard's cost; pushes are row-wise Adagrad, the only
    optimizer that pass applies."""
    servers = int(probe.get("servers", 1))
    points: dict[str, list[tuple[float, float, float]]] = {}
    for p in probe["store"]:
        k, rows = float(p["tables"]), float(p["tables"] * p["rows"]) / servers
        for kind in ("pull", "pull_check", "push"):
            points.setdefault(kind, []).append((k, rows, float(p[f"server_{kind}_s"])))
    return StoreCosts(
        pull=fit_linear(points["pull"]),
        pull_check=fit_linear(points["pull_check"]),
        push={"rowwise_adagrad": fit_linear(points["push"])},
    )


def wire_costs(probe: dict[str, Any], slowdown: float = 1.0) -> WireCosts:
    """The MPI store's cost beyond the servers' own work (their busy time, measured):
    per message, per table request and per row. (With one message per table the first
    two cannot be told apart; the model then uses their sum, as the calibration saw
    it.) With S servers the messages are counted over all of them. ``slowdown``: the
    factor by which processes sharing too few cores ran slower (the model's P / C),
    taken out of the times first."""
    fits: dict[str, list[float]] = {}
    for kind in ("pull", "pull_check", "push"):
        design, times = [], []
        for p in probe["store"]:
            k, rows, messages = p["tables"], p["tables"] * p["rows"], p[f"{kind}_messages"]
            design.append([float(messages), float(k), float(rows)])
            times.append(max((p[kind] - p[f"server_{kind}_s"]) / slowdown, 0.0))
        fits[kind] = fit(design, times)
    return WireCosts(
        pull=Linear(alpha_s=fits["pull"][0], beta_s=fits["pull"][2]),
        pull_check=Linear(alpha_s=fits["pull_check"][0], beta_s=fits["pull_check"][2]),
        push=Linear(alpha_s=fits["push"][0], beta_s=fits["push"][2]),
        per_table_s={kind: f[1] for kind, f in fits.items()},
        messages_per_batch=float(probe["messages_per_batch"]),
    )


def sharded_costs(probe: dict[str, Any], collectives: dict[str, Linear]) -> EmbeddingCosts:
    """A sharded collection's own work at 2 ranks, its 4 exchanges' modeled time
    (half of each rank's distinct ids go to the other rank) subtracted."""
    a2a = collectives["alltoallv"]
    design, times = [], []
    for p in probe["sharded"]:
        sent = 0.5 * p["unique"] * (8 + 2 * 4 * DIM) + 8 * p["tables"]
        design.append([1.0, p["lookups"], p["unique"]])
        times.append(max(p["seconds"] - 4 * a2a.alpha_s - a2a.beta_s * sent, 0.0))
    alpha, per_lookup, per_unique = fit(design, times)
    return EmbeddingCosts(alpha_s=alpha, per_lookup_s=per_lookup, per_unique_s=per_unique)


def sync_delay_of(probe3: dict[str, Any], collectives: dict[str, Linear]) -> float:
    """Seconds each round of a collective waits for a descheduled rank, from the smallest
    allreduce and alltoallv at 3 ranks: their time beyond the 2-rank costs scaled to 3
    ranks (2 rounds each) and slowed by the model's P / C, per round. 0 with 3 cores."""
    cores = os.cpu_count() or 1
    if cores >= 3:
        return 0.0
    slow = 3 / cores
    delays = []
    for name in ("allreduce", "alltoallv"):
        nbytes, seconds = min(probe3["collectives"][name], key=lambda p: p[0])
        c = collectives[name]
        expected = slow * (2 * c.alpha_s + c.beta_s * nbytes)
        delays.append(max(0.0, (seconds - expected) / 2))
    return float(np.mean(delays))


def collective_costs(probe: dict[str, Any] | None) -> dict[str, Linear]:
    if probe is None:
        zero = Linear(alpha_s=0.0, beta_s=0.0)
        return {"allreduce": zero, "alltoallv": zero, "allgatherv": zero}
    return {
        name: fit_linear([(1.0, float(b), s) for b, s in points])
        for name, points in probe["collectives"].items()
    }


# ---------------------------------------------------------------- all


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
        job_embedding, cache_costs = calibrate_job(quick, data, dense, server)
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
        server=server,
        mpi_wire=None if probe is None else wire_costs(probe),
        mpi_wire_sharded=None
        if probe3 is None
        else wire_costs(probe3, max(1.0, 3 / (os.cpu_count() or 1))),
        collectives=collectives,
        sync_delay_s=sync_delay,
    )
