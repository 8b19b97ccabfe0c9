"""The DLRM job's part of the calibration: its steps on one process
(:func:`hybridrec.dlrm.measure.step_seconds`), less the parts timed on their own, fitted
to the job's own embedding work and the cache's."""

from __future__ import annotations

import numpy as np

from hybridrec.dlrm.config import DLRMJobConfig
from hybridrec.dlrm.measure import step_seconds
from hybridrec.plan.calibrate_store import store_share
from hybridrec.plan.costs import CacheCosts, DenseCosts, EmbeddingCosts, Linear, StoreCosts
from hybridrec.plan.fromjob import plan_from_dlrm
from hybridrec.plan.idlaw import TrafficModel
from hybridrec.plan.timing import fit

JOB_ROWS = 20_000  # rows per table of the synthetic data the job steps are timed on


def job_step_seconds(
    options: list[str], quick: bool, *, cached: bool = False
) -> tuple[DLRMJobConfig, list[float]]:
    """The job's config and steady-state step seconds (one per logged block) on 26
    synthetic tables with ``options``. A cached run warms up longer: its cache fills
    over its first steps, and a step with evictions costs more than one without
    (measured: 40-45 ms in the first 30 steps at batch 1024 and 20 % of the rows, 48-52
    ms after)."""
    if cached:
        steps, every, warm = (30, 5, 15) if quick else (50, 5, 25)
    else:
        steps, every, warm = (20, 4, 8) if quick else (30, 5, 10)
    data = ["--data", "synthetic", "--synthetic-rows", str(JOB_ROWS), "--synthetic-samples",
            "80000"]  # fmt: skip
    return step_seconds([*data, *options], steps=steps, log_every=every, warm_steps=warm)


def calibrate_job(
    quick: bool, data: Linear, dense: DenseCosts, server: dict[str, StoreCosts]
) -> tuple[dict[str, EmbeddingCosts], CacheCosts, CacheCosts, float]:
    """The job's own embedding work (local and hybrid placement) and the cache's, from
    the DLRM job's steps on one process (an in-process store) at several batch sizes:
    what is left of a step after the batch assembly, the dense part and the store's
    share (the sampled traffic on the fitted shard costs) is fitted per step, per id
    looked up and per distinct id (the cache: per table step, per distinct id, per row
    fetched, beyond the uncached hybrid step). The cache is fitted twice: as its
    tables' sole writer (what one worker is) and with ``--other-writers`` (what every
    worker's cache is with several workers: it asks about every row it serves). Every
    fitted run has the sparse pipeline off; one cached run is repeated with it on, and
    the share of the modelled overlap it achieved is the last value returned."""

    def cache_opts(fraction: float, shared: bool) -> list[str]:
        # The cache's work with its prefetch on: the step the model counts (a serving
        # pull, a prefetch and a push). The jobs' caches no longer prefetch by default,
        # so for them the model counts the prefetch's plan and install on top: an upper
        # bound of the cache's work.
        return ["--cache-fraction", str(fraction), "--cache-policy", "lfu", "--read-bound", "4",
                "--write-bound", "4", "--cache-prefetch", "on",
                *(["--other-writers"] if shared else [])]  # fmt: skip

    batches = (128, 1024) if quick else (128, 512, 1024)
    # the cached runs vary the cache size too, so that rows fetched and distinct ids
    # do not grow together (the fit tells them apart)
    cached_runs = [(128, 0.2), (1024, 0.02)] if quick else [(128, 0.2), (512, 0.02),
                                                             (1024, 0.2), (1024, 0.02)]  # fmt: skip
    shard = server["dense"]
    traffic = TrafficModel()
    emb: dict[str, EmbeddingCosts] = {}
    fits: dict[str, tuple[list[list[float]], list[float]]] = {}
    variants = ("local", "hybrid", "cached", "shared")
    piped = max(cached_runs)  # the cached run also timed with the sparse pipeline on

    def options(variant: str, b: int, fraction: float) -> list[str]:
        # every fitted run unpipelined (--sparse-pipeline auto would turn the pipeline
        # on here, where a core is free, and hide part of what is fitted); "piped" is
        # the cached run with it on, which measures how much of the sparse step it hides
        opts = ["--batch-size", str(b), "--placement", "local" if variant == "local" else "hybrid",
                "--sparse-pipeline", "on" if variant == "piped" else "off"]  # fmt: skip
        return opts + (cache_opts(fraction, variant == "shared") if fraction else [])

    configs = [("local", b, 0.0) for b in batches] + [("hybrid", b, 0.0) for b in batches]
    configs += [(v, b, f) for v in ("cached", "shared") for b, f in cached_runs]
    configs.append(("piped", *piped))
    # every configuration once per round, the rounds one after the other: a burst of
    # other work on the machine then slows one run of each, not all runs of one
    blocks: dict[tuple[str, int, float], list[float]] = {c: [] for c in configs}
    job_configs: dict[tuple[str, int, float], DLRMJobConfig] = {}
    for _ in range(1 if quick else 2):
        for c in configs:
            job_configs[c], seconds = job_step_seconds(options(*c), quick, cached=c[2] > 0)
            blocks[c] += seconds
    for variant in variants:
        placement = "local" if variant == "local" else "hybrid"
        with_cache = variant in ("cached", "shared")
        runs = cached_runs if with_cache else [(b, 0.0) for b in batches]
        for b, fraction in runs:
            step = float(np.median(blocks[(variant, b, fraction)]))
            plan = plan_from_dlrm(job_configs[(variant, b, fraction)], workers=1)
            tr = traffic.traffic(plan)
            model = plan.model
            rest = step - data(1, b) - dense.alpha_s - dense.s_per_param * model.dense_params
            rest -= dense.s_per_flop * model.dense_flops_per_sample * b
            lookups = sum(t.lookups for t in tr.values())
            unique = sum(t.unique for t in tr.values())
            if placement == "hybrid":
                rest -= sum(store_share(shard, t) for t in tr.values())
            if with_cache:
                h = emb["hybrid"]
                rest -= h.alpha_s + h.per_lookup_s * lookups + h.per_unique_s * unique
                row = [float(len(tr)), unique, sum(t.returned for t in tr.values())]
            else:
                row = [1.0, lookups, unique]
            fits.setdefault(variant, ([], []))
            fits[variant][0].append(row)
            fits[variant][1].append(max(rest, 0.0))
        if not with_cache:
            alpha, per_lookup, per_unique = fit(*fits[variant])
            emb[variant] = EmbeddingCosts(
                alpha_s=alpha, per_lookup_s=per_lookup, per_unique_s=per_unique
            )
    sole, shared = (
        CacheCosts(per_table_s=t, per_id_s=i, per_admit_s=a)
        for t, i, a in (fit(*fits["cached"]), fit(*fits["shared"]))
    )
    # The pipeline's overlap: what it hid in the cached run, measured (unpipelined minus
    # pipelined step), over what the model would hide there, min(sparse step, the rest).
    plan = plan_from_dlrm(job_configs[("cached", *piped)], workers=1)
    tr = traffic.traffic(plan)
    h, model, b = emb["hybrid"], plan.model, piped[0]
    sparse = sum(store_share(shard, t) for t in tr.values()) + sole.work(tr.values())
    rest = data(1, b) + dense.alpha_s + dense.s_per_param * model.dense_params
    rest += dense.s_per_flop * model.dense_flops_per_sample * b
    rest += h.alpha_s + sum(h.per_lookup_s * t.lookups + h.per_unique_s * t.unique
                            for t in tr.values())  # fmt: skip
    hidden = float(np.median(blocks[("cached", *piped)]) - np.median(blocks[("piped", *piped)]))
    overlap = float(np.clip(hidden / max(min(sparse, rest), 1e-9), 0.0, 1.0))
    return emb, sole, shared, overlap
