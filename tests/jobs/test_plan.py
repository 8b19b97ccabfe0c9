"""The capacity planner (hybridrec.plan): id-law sampling against the exact law, the cache
simulation against a per-id Python model, the step-time arithmetic on hand-made costs,
the CLI end to end and its errors, and a quick calibration on this machine."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from hybridrec.plan import idlaw
from hybridrec.plan.__main__ import main
from hybridrec.plan.costs import CacheCosts, Costs, StoreCosts, load_costs, save_costs
from hybridrec.plan.idlaw import (
    FileSampler,
    TableTraffic,
    TrafficModel,
    ZipfSampler,
    simulate_table,
)
from hybridrec.plan.model import predict
from hybridrec.plan.options import PlanOptions, parse_table, plan_of
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

# The cost model's formulas and the simulations' means are float64 arithmetic on both
# sides, in orders that may differ: a few dozen roundings of u = 1.1e-16 at most, so a
# relative 1e-12 cannot fail by rounding and still tells any wrong term.
F64 = 1e-12


# ---------------------------------------------------------------- fixtures


def lin(alpha: float, beta: float) -> dict[str, float]:
    return {"alpha_s": alpha, "beta_s": beta}


def store_costs(scale: float) -> dict[str, object]:
    return {
        "pull": lin(10e-6 * scale, 1e-8 * scale),
        "pull_check": lin(8e-6 * scale, 2e-9 * scale),
        "push": {"rowwise_adagrad": lin(12e-6 * scale, 3e-8 * scale)},
    }


COSTS_JSON: dict[str, object] = {
    "schema": "hybridrec.plan.costs",
    "version": 3,
    "device": "cpu",
    "machine": {"cpus": 2},
    "dim": 16,
    "data": lin(1e-4, 1e-7),
    "dense": {"alpha_s": 1e-3, "s_per_param": 1e-9, "s_per_flop": 1e-11},
    "embedding": {
        k: {"alpha_s": 5e-4, "per_lookup_s": 5e-8, "per_unique_s": 4e-8}
        for k in ("local", "hybrid", "sharded")
    },
    "cache": {"per_table_s": 2e-4, "per_id_s": 1e-7, "per_admit_s": 2e-7},
    "cache_shared": {"per_table_s": 3e-4, "per_id_s": 2e-7, "per_admit_s": 4e-7},
    "server": {"dense": store_costs(1.0), "sparse": store_costs(3.0)},
    "mpi_wire": {
        "pull": lin(3e-5, 3e-9),
        "pull_check": lin(3e-5, 5e-9),
        "push": lin(3e-5, 3e-8),
        "per_table_s": {"pull": 2e-6, "pull_check": 2e-6, "push": 3e-6},
        "messages_per_batch": 1.0,
    },  # fmt: skip
    "mpi_wire_sharded": None,
    "collectives": {k: lin(2e-5, 3e-10) for k in ("allreduce", "alltoallv", "allgatherv")},
    "sync_delay_s": 5e-4,
    "pipeline_overlap": 1.0,
}


@pytest.fixture
def costs_file(tmp_path: Path) -> Path:
    p = tmp_path / "costs.json"
    p.write_text(json.dumps(COSTS_JSON), encoding="utf-8")
    return p


def small_plan(workers: int, servers: int = 1, **cluster: object) -> Plan:
    tables = [TablePlan(name=f"t{i}", rows=5000, dim=16) for i in range(3)]
    model = ModelPlan(tables=tables, dense_flops_per_sample=1e5, dense_params=20_000)
    return Plan(
        model=model,
        cluster=ClusterPlan(workers=workers, servers=servers, batch_per_worker=256, **cluster),  # type: ignore[arg-type]
    )


# ---------------------------------------------------------------- the id law


def test_zipf_sampler_draws_the_exact_law(monkeypatch: pytest.MonkeyPatch) -> None:
    """Head (exact CDF) and tail (inverted integral) against the exact probabilities
    ``k**-a / H``: the head's ranks one by one, the tail's mass per decade."""
    monkeypatch.setattr(idlaw, "HEAD", 8)
    rows, a = 2000, 1.2
    s = ZipfSampler(rows, a)
    draws = s.draw(np.random.default_rng(0), 400_000)
    p = np.arange(1, rows + 1, dtype=np.float64) ** -a
    p /= p.sum()
    freq = np.bincount(draws, minlength=rows) / draws.size
    # Statistical bands, not rounding: a frequency of N = 400,000 draws has sd
    # sqrt(p (1 - p) / N) <= 7e-4 here, so 4e-3 is about 6 sd for the head's ranks; the
    # tail's decades (sd <= 7e-4 too) also carry the inverted integral's approximation of
    # the sum, hence the wider 0.01. A wrong exponent or normalization is off by more.
    np.testing.assert_allclose(freq[:8], p[:8], atol=4e-3)
    for lo, hi in ((8, 80), (80, 800), (800, rows)):  # the tail, by decade
        assert abs(freq[lo:hi].sum() - p[lo:hi].sum()) < 0.01, (lo, hi)
    assert draws.min() >= 0 and draws.max() < rows


def test_distinct_ids_per_step_match_the_exact_expectation() -> None:
    """Mean distinct ids of ``d`` draws = sum_k 1 - (1 - p_k)^d (exact for the law)."""
    rows, a, d = 3000, 1.05, 500
    s = ZipfSampler(rows, a)
    p = np.arange(1, rows + 1, dtype=np.float64) ** -a
    p /= p.sum()
    exact = float((-np.expm1(d * np.log1p(-p))).sum())
    got = idlaw.uncached_traffic(s, d, 200, seed=1).unique
    assert abs(got - exact) / exact < 0.01  # a statistical band: the mean of 200 steps' counts
    # Two float64 formulas of one probability (-expm1(d log1p(-p)) and 1 - (1 - p)^d, p
    # normalized by sums in other orders): a few hundred roundings at most, under F64.
    want = 1 - (1 - p[0]) ** d
    assert s.touch_probability(d, np.array([0]))[0] == pytest.approx(want, rel=F64, abs=0)


def test_file_sampler_ranks_by_frequency(tmp_path: Path) -> None:
    ids = np.array([7] * 6 + [3] * 3 + [9])  # 7 most frequent, then 3, then 9
    s = FileSampler(ids, "test")
    assert s.rows == 3
    # Bit for bit: counts / size is one correctly rounded division, as the literals are.
    np.testing.assert_array_equal(s.p, [0.6, 0.3, 0.1])
    freq = np.bincount(s.draw(np.random.default_rng(0), 50_000), minlength=3) / 50_000
    # A statistical band: 50,000 draws give sd <= 2.2e-3 per frequency; 0.01 is 4.5 sd.
    np.testing.assert_allclose(freq, [0.6, 0.3, 0.1], atol=0.01)
    path = tmp_path / "ids.npz"
    np.savez(path, a=ids, b=ids[::-1].copy())
    assert sorted(idlaw.load_id_file(str(path), ["a", "b"])) == ["a", "b"]
    with pytest.raises(ValueError, match=r"lacks tables \['c'\]"):
        idlaw.load_id_file(str(path), ["a", "c"])


# ---------------------------------------------------------------- the cache simulation


def reference_cache(
    batches: list[np.ndarray], capacity: int, write_bound: int, warm: int, tinylfu: bool = False
) -> dict[str, float]:
    """A per-id Python model of one worker's LFU cache (no other workers), the same
    step as :func:`simulate_table`: serve batch s (prefetched), prefetch the misses of
    batch s + 1 (evicting the least used rows not in batch s or s + 1, oldest first on
    ties, pushing those with pending updates), push batch s's rows past the bound.
    ``tinylfu``: a row's count is its lookups so far, and the misses, most looked up
    first, take the free slots and then only the slots of victims they beat."""
    cached: list[int] = []  # admission order
    seen: dict[int, int] = {}  # tinylfu: lookups so far
    freq: dict[int, int] = {}
    pending: dict[int, int] = {}
    sums = dict.fromkeys(("unique", "pulled", "pushed", "hits"), 0.0)
    fetched_for_cur = 0
    counted = 0
    for s in range(len(batches) - 1):
        cur, nxt = [int(x) for x in batches[s]], [int(x) for x in batches[s + 1]]
        misses = [i for i in nxt if i not in freq]
        evict_pushed = 0
        free = capacity - len(cached)
        busy = set(cur) | set(nxt)
        fetched = len(misses)  # admitted or served through, each is pulled
        if tinylfu and len(misses) > free:
            misses = sorted(misses, key=lambda i: -seen.get(i, 0))
            victims = sorted(freq[i] for i in cached if i not in busy)
            admitted = misses[:free]
            for i, v in zip(misses[free:], victims, strict=False):
                if seen.get(i, 0) <= v:
                    break
                admitted.append(i)
            misses = admitted
        if len(misses) > free:
            cand = [i for i in cached if i not in busy]
            chunk = 1 if tinylfu else max(1, capacity // 16)
            need = min(max(len(misses) - free, chunk), len(cand))
            victims = sorted(cand, key=lambda i: freq[i])[:need]  # sorted() is stable
            for v in victims:
                evict_pushed += pending[v] > 0
                cached.remove(v)
                del freq[v], pending[v]
        for i in misses[: capacity - len(cached)]:
            cached.append(i)
            freq[i] = seen.get(i, 0) if tinylfu else 0
            pending[i] = 0
        pushed = evict_pushed
        for i in cur:
            seen[i] = seen.get(i, 0) + 1
            if i in freq:
                pending[i] += 1
                freq[i] = seen[i] if tinylfu else freq[i] + 1
                if pending[i] > write_bound:
                    pending[i] = 0
                    pushed += 1
            else:
                pushed += 1
        hits = len(cur) - fetched_for_cur
        fetched_for_cur = fetched
        if s >= warm:
            counted += 1
            for k, v in (("unique", len(cur)), ("pulled", fetched), ("pushed", pushed),
                         ("hits", hits)):  # fmt: skip
                sums[k] += v
    return {k: v / counted for k, v in sums.items()}


@pytest.mark.parametrize("policy", ["lfu", "tinylfu"])
def test_lfu_simulation_equals_a_per_id_model(policy: str) -> None:
    rows, draws, capacity, write_bound = 400, 60, 48, 2
    sampler = ZipfSampler(rows, 1.1)
    plan = CachePlan(rows=capacity, write_bound=write_bound, policy=policy)
    traffic = simulate_table(sampler, draws, plan, capacity, 1, seed=3, measure_steps=30)
    # the same draws: simulate_table draws step by step from one generator
    rng = np.random.default_rng(3)
    batches = [np.unique(sampler.draw(rng, draws)) for _ in range(200)]
    # the simulation counts from the step the cache first became full
    full = next(s for s in range(200) if _filled(batches, capacity, s))
    ref = reference_cache(
        batches[: full + 30 + 2], capacity, write_bound, warm=full + 1, tinylfu=policy == "tinylfu"
    )
    # Means of integer counts over the same steps, in float64 (F64).
    assert traffic.unique == pytest.approx(ref["unique"], rel=F64)
    assert traffic.pulled == pytest.approx(ref["pulled"], rel=F64)
    assert traffic.pushed == pytest.approx(ref["pushed"], rel=F64)
    assert traffic.hit_rate == pytest.approx(ref["hits"] / ref["unique"], rel=F64)
    assert traffic.asked == traffic.unique and traffic.refreshed == 0  # one worker


def _filled(batches: list[np.ndarray], capacity: int, step: int) -> bool:
    """Whether the distinct ids prefetched up to ``step`` (batches 1 .. step + 1) reach
    ``capacity`` (the cache admits every miss until it is full)."""
    return np.unique(np.concatenate(batches[1 : step + 2])).size >= capacity


def test_other_workers_make_copies_stale() -> None:
    sampler = ZipfSampler(2000, 1.05)
    plan = CachePlan(fraction=0.1, read_bound=0, write_bound=0)
    one = simulate_table(sampler, 200, plan, 200, 1, seed=0)
    many = simulate_table(sampler, 200, plan, 200, 8, seed=0)
    assert one.refreshed == 0 and many.refreshed > 0
    assert many.hit_rate < one.hit_rate


# ---------------------------------------------------------------- the cost model


def test_server_queueing_grows_with_workers_as_the_formula_says(costs_file: Path) -> None:
    costs = load_costs(costs_file)
    tm = TrafficModel()
    two, four = small_plan(2), small_plan(4)
    p2, p4 = predict(two, costs, tm.traffic(two)), predict(four, costs, tm.traffic(four))
    tr = tm.traffic(two)
    # one server, a fixed table: pull and push service of one worker's rows, per table
    srv = costs.server["dense"]
    pull = sum(srv.pull(1, t.unique) for t in tr.values())
    push = sum(srv.push_of("rowwise_adagrad")(1, t.unique) for t in tr.values())
    assert p2.parts["server_queueing"] == pytest.approx(1 * (pull + push), rel=F64)
    assert p4.parts["server_queueing"] == pytest.approx(3 * (pull + push), rel=F64)
    # batched protocol (messages_per_batch 1): one pull and one push message per server
    wire = costs.mpi_wire
    assert wire is not None
    rows = sum(t.unique for t in tr.values())
    tau = wire.per_table_s
    assert p2.parts["pull"] == pytest.approx(pull + wire.pull(1, rows) + 3 * tau["pull"], rel=F64)
    assert p2.parts["push"] == pytest.approx(push + wire.push(1, rows) + 3 * tau["push"], rel=F64)
    per_table = predict(two.with_(protocol="per-table"), costs, tr)
    assert per_table.parts["pull"] == pytest.approx(
        pull + wire.pull(3, rows) + 3 * tau["pull"], rel=F64
    )
    # allreduce: alpha ceil(log2 W) + beta 2 (W - 1) / W bytes
    ar = costs.collectives["allreduce"]
    assert p4.parts["allreduce"] == pytest.approx(
        ar.alpha_s * 2 + ar.beta_s * 1.5 * 80_000, rel=F64
    )
    assert p4.step_s == pytest.approx(sum(p4.parts.values()), rel=F64)
    assert p4.samples_per_s == pytest.approx(4 * 256 / p4.step_s, rel=F64)


def test_more_servers_split_rows_and_shared_cores_slow_every_process(costs_file: Path) -> None:
    costs = load_costs(costs_file)
    tm = TrafficModel()
    one, two = small_plan(4, 1), small_plan(4, 2)
    tr = tm.traffic(one)
    srv1 = srv2 = costs.server["dense"]  # several servers split fixed tables densely too
    rows = sum(t.unique for t in tr.values())
    q1 = predict(one, costs, tr).parts["server_queueing"]
    q2 = predict(two, costs, tr).parts["server_queueing"]
    push = srv1.push_of("rowwise_adagrad")
    assert q1 == pytest.approx(3 * (srv1.pull(3, rows) + push(3, rows)), rel=F64)
    push2 = srv2.push_of("rowwise_adagrad")
    assert q2 == pytest.approx(3 * (srv2.pull(3, rows / 2) + push2(3, rows / 2)), rel=F64)
    shared = dataclass_replace_device(one, DevicePlan(shared_cores=2))
    p, s = predict(one, costs, tr), predict(shared, costs, tr)
    # 4 workers + 1 server on 2 cores: each at 2/5 speed, and the allreduce's 2 rounds
    # and the 2 request phases (pull, push) each wait for a descheduled process
    assert s.step_s == pytest.approx(p.step_s * 5 / 2 + 4 * costs.sync_delay_s, rel=F64)
    assert s.bottleneck == "shared_cores"


def dataclass_replace_device(plan: Plan, device: DevicePlan) -> Plan:
    return plan.with_(device=device)


def test_network_adds_latency_and_bandwidth(costs_file: Path) -> None:
    costs = load_costs(costs_file)
    tm = TrafficModel()
    plan = small_plan(2)
    tr = tm.traffic(plan)
    here = predict(plan, costs, tr)
    slow = predict(plan.with_(network=NetworkPlan(bandwidth_gbps=1, latency_us=100)), costs, tr)
    assert slow.parts["pull"] > here.parts["pull"] + 2 * 100e-6
    assert slow.parts["allreduce"] >= 80_000 * 8 / 1e9  # the dense gradient at 1 Gb/s
    assert slow.network == "1 Gb/s" and here.network == "this machine"


def test_costs_round_trip_and_bad_files(tmp_path: Path, costs_file: Path) -> None:
    costs = load_costs(costs_file)
    again = load_costs(save_costs(costs, tmp_path / "again.json"))
    assert again.to_json() == costs.to_json()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**COSTS_JSON, "version": 99}), encoding="utf-8")
    with pytest.raises(ValueError, match="version 99"):
        load_costs(bad)
    broken = dict(COSTS_JSON)
    del broken["dense"]
    bad.write_text(json.dumps(broken), encoding="utf-8")
    with pytest.raises(ValueError, match="missing key 'dense'"):
        load_costs(bad)
    with pytest.raises(FileNotFoundError, match="--calibrate"):
        load_costs(tmp_path / "nope.json")
    gpu = Costs.from_json(COSTS_JSON)
    plan = small_plan(1).with_(device=DevicePlan(kind="gpu"))
    with pytest.raises(ValueError, match="calibrated on 'cpu'"):
        predict(plan, gpu, TrafficModel().traffic(plan))


def test_bad_inputs_name_the_field_and_value() -> None:
    with pytest.raises(ValueError, match=r"TablePlan\('t'\).rows must be an int >= 1, got 0"):
        TablePlan(name="t", rows=0, dim=8)
    with pytest.raises(ValueError, match="placement must be one of"):
        TablePlan(name="t", rows=10, dim=8, placement="remote")
    with pytest.raises(ValueError, match="ClusterPlan.workers must be an int >= 1, got 0"):
        ClusterPlan(workers=0, batch_per_worker=8)
    with pytest.raises(ValueError, match="CachePlan.fraction must be in"):
        CachePlan(fraction=1.5)
    with pytest.raises(ValueError, match="IdLaw.zipf_a"):
        IdLaw(zipf_a=-1)
    with pytest.raises(ValueError, match="NetworkPlan.bandwidth_gbps"):
        NetworkPlan(bandwidth_gbps=0)
    with pytest.raises(ValueError, match="no table is hybrid"):
        Plan(
            model=small_plan(1).model.with_placement("local"),
            cluster=ClusterPlan(workers=1, batch_per_worker=8),
            cache=CachePlan(fraction=0.1),
        )
    with pytest.raises(ValueError, match="expected NAME:ROWS:DIM"):
        parse_table("items:100")
    assert parse_table("items:100:8:2:1.5:sharded:sgd") == TablePlan(
        name="items", rows=100, dim=8, features=2, pooling=1.5, placement="sharded",
        optimizer="sgd",
    )  # fmt: skip
    assert parse_table("items:100:8:1:1:hybrid:adam:bf16").dtype == "bf16"
    assert parse_table("items:100:8", default_dtype="fp16").dtype == "fp16"
    with pytest.raises(ValueError, match=r"TablePlan\('items'\).dtype must be one of"):
        parse_table("items:100:8:1:1:hybrid:adam:fp8")
    with pytest.raises(ValueError, match=r"TablePlan\('t'\).optimizer must be one of"):
        TablePlan(name="t", rows=10, dim=8, optimizer="lamb")
    with pytest.raises(ValueError, match="with dlrm the job's own --emb-dtype"):
        PlanOptions(dlrm="--data synthetic", emb_dtype="bf16")
    explicit = plan_of(PlanOptions(tables=2, emb_dtype="fp16"))
    assert [t.dtype for t in explicit.model.tables] == ["fp16", "fp16"]


# ---------------------------------------------------------------- from the job, the CLI


def test_plan_from_the_dlrm_job_options() -> None:
    from dense import DLRMConfig, DLRMDense
    from hybridrec.dlrm.job import parse_args
    from hybridrec.plan.fromjob import plan_from_dlrm

    cfg = parse_args(
        ["--data", "synthetic", "--synthetic-rows", "5000", "--batch-size", "768", "--ps",
         "mpi:2", "--cache-fraction", "0.1", "--write-bound", "4"]
    )  # fmt: skip
    plan = plan_from_dlrm(cfg, workers=3)
    assert len(plan.model.tables) == 26 and {t.rows for t in plan.model.tables} == {5000}
    assert {t.placement for t in plan.model.tables} == {"hybrid"}  # auto: hybrid with mpi
    assert plan.cluster.batch_per_worker == 256 and plan.cluster.servers == 2
    assert plan.cache.fraction == 0.1 and plan.cache.write_bound == 4
    dense = DLRMDense(DLRMConfig(num_dense=13, num_sparse=26, embedding_dim=16,
                                 bottom_mlp=[64, 16], top_mlp=[64, 32, 1]))  # fmt: skip
    assert plan.model.dense_params == sum(p.numel() for p in dense.parameters())
    with pytest.raises(ValueError, match="must split evenly over 5 workers"):
        plan_from_dlrm(cfg, workers=5)
    assert {t.dtype for t in plan.model.tables} == {"fp32"}
    narrow = plan_from_dlrm(
        parse_args(["--data", "synthetic", "--emb-dtype", "bf16", "--emb-dtype-of", "cat3=fp16"]),
        workers=1,
    )
    assert {t.name: t.dtype for t in narrow.model.tables if t.dtype != "bf16"} == {"cat3": "fp16"}
    with pytest.raises(ValueError, match="emb_dtype_of user=fp16: no table 'user'"):
        plan_from_dlrm(
            parse_args(["--data", "synthetic", "--emb-dtype-of", "user=fp16"]), workers=1
        )
    gpu_sized = parse_args(
        ["--data", "synthetic", "--batch-size", "768", "--cache-memory", "0.2", "--ps", "mpi:2"]
    )
    with pytest.raises(ValueError, match="--cache-memory 0.2 sizes a GPU cache"):
        plan_from_dlrm(gpu_sized, workers=3)


def test_cli_writes_table_json_and_png(
    costs_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    args = ["--costs", str(costs_file), "--tables", "4", "--rows", "5000", "--workers", "8",
            "--batch-per-worker", "128", "--sweep-workers", "1", "4", "16",
            "--sweep-bandwidth", "25", "--bandwidth-gbps", "10", "--latency-us", "20"]  # fmt: skip
    main([*args, "--png", str(png)])
    text = capsys.readouterr().out
    assert "this plan: W=8 S=1 on 10 Gb/s" in text and "recommendation:" in text
    assert png.stat().st_size > 1000
    main([*args, "--json", "--no-recommend", "--cache-fraction", "0.05"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [p["workers"] for p in out["sweep"]] == [1, 4, 16, 1, 4, 16]
    assert {p["network"] for p in out["sweep"]} == {"10 Gb/s", "25 Gb/s"}
    assert out["prediction"]["hit_rate"] is not None and "recommendation" not in out
    config = tmp_path / "plan.toml"
    config.write_text(
        f'costs = "{costs_file}"\ntables = 2\nworkers = 2\njson = true\nrecommend = false\n'
        "sweep-workers = [1, 2]\nsweep-bandwidth = [100.0]\n"
    )
    main(["--config", str(config)])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["plan"]["model"]["tables"]) == 2 and len(out["sweep"]) == 4


def test_cli_errors_are_one_line(costs_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--tables", "2"])
    assert e.value.code == 2
    assert "no costs: give --costs costs.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--costs", str(costs_file), "--table", "x:0:8"])
    assert "TablePlan('x').rows must be an int >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--costs", str(costs_file), "--global-batch", "10", "--workers", "3"])
    assert "must split evenly over 3 workers" in capsys.readouterr().err


# ---------------------------------------------------------------- calibration fits


def test_fits_recover_known_costs_and_never_go_negative() -> None:
    from hybridrec.plan.calibrate_mpi import wire_costs
    from hybridrec.plan.timing import fit, fit_linear

    line = fit_linear([(1, 10, 1.0 + 0.5 * 10), (2, 100, 2.0 + 0.5 * 100), (3, 7, 3.0 + 3.5)])
    # Least squares (numpy's SVD lstsq) of points that fit exactly, on a well-conditioned
    # design: float64 rounding only (F64).
    assert line.alpha_s == pytest.approx(1.0, rel=F64) and line.beta_s == pytest.approx(
        0.5, rel=F64
    )
    coef = fit([[1, 1], [1, 2], [1, 3]], [3.0, 2.0, 1.0])  # a negative slope is refitted as 0
    assert coef[1] == 0.0 and coef[0] == pytest.approx(2.0, rel=F64)
    # the MPI store's wire cost: measured time minus the server's measured busy time, per
    # message, per table request and per row (batched: one message for several tables);
    # the server's own cost: its busy time per table request and per row
    from hybridrec.plan.calibrate_mpi import mpi_server_costs

    points: list[dict[str, float]] = []
    for k, n in ((1, 64), (8, 64), (1, 2048), (8, 2048)):
        rows = k * n
        point: dict[str, float] = {"tables": k, "rows": n}
        for kind in ("pull", "pull_check", "push"):
            own = 1e-6 * k + 4e-9 * rows + (2e-8 * rows if kind == "push" else 0.0)
            point[f"{kind}_messages"] = 1
            point[f"server_{kind}_s"] = own
            point[kind] = own + 40e-6 + 3e-6 * k + 2e-8 * rows
        points.append(point)
    probe = {"store": points, "messages_per_batch": 1.0}
    wire = wire_costs(probe)
    server = mpi_server_costs(probe)
    for kind in ("pull", "pull_check", "push"):
        got = getattr(wire, kind)
        # Not a rounding bound: the fit of exact points is off by about its design's
        # condition number (per-message, per-table and per-row columns, rows 64 to 16,384)
        # times u, measured 1e-13; 1e-6 still tells a wrong model (a missing or doubled
        # term) by orders of magnitude.
        assert got.alpha_s == pytest.approx(40e-6, rel=1e-6)
        assert got.beta_s == pytest.approx(2e-8, rel=1e-6)
        assert wire.per_table_s[kind] == pytest.approx(3e-6, rel=1e-6)
        own = server.push_of("rowwise_adagrad") if kind == "push" else getattr(server, kind)
        assert own.alpha_s == pytest.approx(1e-6, rel=1e-6)
        assert own.beta_s == pytest.approx(4e-9 + (2e-8 if kind == "push" else 0.0), rel=1e-6)


def test_mpi_batches_are_charged_the_servers_measured_cost() -> None:
    """With an MPI calibration, a server's service of a batched request is its own
    measured cost (``server["mpi"]``: it serves fixed tables whole in C); requests sent
    one table at a time take the shard's per-table path."""
    server = {"dense": store_costs(1.0), "sparse": store_costs(3.0), "mpi": store_costs(0.1)}
    data = {**COSTS_JSON, "server": server}
    costs = Costs.from_json(data)
    tm = TrafficModel()
    plan = small_plan(4)
    tr = tm.traffic(plan)
    fast, slow = costs.server["mpi"], costs.server["dense"]

    def queue(pull: StoreCosts, push: StoreCosts, optimizer: str = "rowwise_adagrad") -> float:
        p = sum(pull.pull(1, t.unique) for t in tr.values())
        q = sum(push.push_of(optimizer)(1, t.unique) for t in tr.values())
        return 3 * (p + q)

    got = predict(plan, costs, tr).parts["server_queueing"]
    assert got == pytest.approx(queue(fast, fast), rel=F64)
    per_table = predict(plan.with_(protocol="per-table"), costs, tr)
    assert per_table.parts["server_queueing"] == pytest.approx(queue(slow, slow), rel=F64)
    # a batch with a narrow table's part is served in Python, part by part, whole
    narrow = plan.with_(model=_with_dtypes(plan.model, {"t1": "bf16"}))
    got = predict(narrow, costs, tr).parts["server_queueing"]
    assert got == pytest.approx(queue(slow, slow), rel=F64)


def _with_dtypes(model: ModelPlan, dtypes: dict[str, str]) -> ModelPlan:
    tables = [dataclasses.replace(t, dtype=dtypes.get(t.name, t.dtype)) for t in model.tables]
    return dataclasses.replace(model, tables=tables)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adagrad", "adam", "ftrl"])
def test_row_bytes_of_each_type_and_optimizer(optimizer: str) -> None:
    """Weights of 4 or 2 bytes per element, the optimizer's float32 state columns (SGD
    0, row-wise Adagrad 1, Adagrad D, Adam 2 D + 1, FTRL 2 D) and an int64 clock."""
    state = {"sgd": 0, "rowwise_adagrad": 1, "adagrad": 64, "adam": 129, "ftrl": 128}
    for dtype, size in (("fp32", 4), ("fp16", 2), ("bf16", 2)):
        t = TablePlan(name="t", rows=10, dim=64, optimizer=optimizer, dtype=dtype)
        assert t.row_bytes == 64 * size + 4 * state[optimizer] + 8, (dtype, t.row_bytes)
    with pytest.raises(ValueError, match=r"TablePlan\('t'\).dtype must be one of \('fp32', "
                       r"'fp16', 'bf16'\), got 'int8'"):  # fmt: skip
        TablePlan(name="t", rows=10, dim=8, dtype="int8")


def test_narrow_rows_halve_the_store_wire_bytes(costs_file: Path) -> None:
    """On a 1 Mb/s link (every link time far above the service), a phase is its wire
    cost plus twice its bytes' link time (the worker's and the one server's link) and
    the round trip's latency (0 here). A row or a gradient is ``E x 16 + 8`` bytes: the
    fp16 plan's phases differ from the fp32 plan's by those bytes and by the wire's
    per-row cost scaled to half a row (``Costs.row_scale(8)`` = 0.75 of a 16-wide row's)."""
    costs = load_costs(costs_file)
    slow = NetworkPlan(bandwidth_gbps=1e-3)
    wide = small_plan(2).with_(network=slow)
    narrow = wide.with_(model=_with_dtypes(wide.model, {f"t{i}": "fp16" for i in range(3)}))
    tr = TrafficModel().traffic(wide)
    p32, p16 = predict(wide, costs, tr), predict(narrow, costs, tr)
    per_byte = 8 / 1e6
    wire = costs.mpi_wire
    assert wire is not None
    rows = sum(t.pulled for t in tr.values())  # no cache: pulled = returned = pushed
    assert rows == sum(t.pushed for t in tr.values())
    saved = 2 * per_byte * rows * (64 + 8 - (32 + 8))  # both links
    # Differences of two phases of a few float64 terms each: their roundings, relative to
    # the phases (which the link times dominate, about 2.3x the difference), stay far below
    # 1e-9 of the difference; a wrong byte count is off by over 10 %.
    assert p32.parts["pull"] - p16.parts["pull"] == pytest.approx(
        saved + 0.25 * wire.pull.beta_s * rows, rel=1e-9
    )
    assert p32.parts["push"] - p16.parts["push"] == pytest.approx(
        saved + 0.25 * wire.push.beta_s * rows, rel=1e-9
    )


def load_costs_dict() -> Costs:
    return Costs.from_json(COSTS_JSON)


def test_the_sparse_pipeline_hides_the_shorter_thread_where_a_core_is_free() -> None:
    """With ``sparse_pipeline`` and a core for each worker's second thread, the step
    is shorter by min(sparse step, the rest of compute); without a free core, or with
    per-rank in-process stores (the job refuses the pipeline there), nothing is hidden."""
    costs = load_costs_dict()
    tm = TrafficModel()
    plain = small_plan(1).with_(cache=CachePlan(fraction=0.1, read_bound=4, write_bound=4))
    tr = tm.traffic(plain)
    base = predict(plain, costs, tr)
    piped = predict(plain.with_(sparse_pipeline=True), costs, tr)
    k = costs.cache
    cache_work = sum(
        k.per_table_s + k.per_id_s * t.unique + k.per_admit_s * t.returned for t in tr.values()
    )
    sparse = base.parts["pull"] + base.parts["push"] + base.parts["server_queueing"] + cache_work
    hidden = min(sparse, base.parts["compute"] - cache_work)
    assert piped.parts["pipelined"] == pytest.approx(-hidden, rel=F64)
    assert piped.step_s == pytest.approx(base.step_s - hidden, rel=F64)
    assert base.parts["pipelined"] == 0.0
    # 1 worker + 1 server on 2 cores: no core for the second thread
    crowded = plain.with_(sparse_pipeline=True, device=DevicePlan(shared_cores=2))
    assert predict(crowded, costs, tr).parts["pipelined"] == 0.0
    roomy = plain.with_(sparse_pipeline=True, device=DevicePlan(shared_cores=3))
    assert predict(roomy, costs, tr).parts["pipelined"] == pytest.approx(-hidden, rel=F64)
    replicas = small_plan(2, store="inprocess", servers=0).with_(sparse_pipeline=True)
    assert predict(replicas, costs, tm.traffic(replicas)).parts["pipelined"] == 0.0
    # the calibration saw 40 % of the modelled overlap: 40 % is hidden
    partial = Costs.from_json({**COSTS_JSON, "pipeline_overlap": 0.4})
    got = predict(plain.with_(sparse_pipeline=True), partial, tr).parts["pipelined"]
    assert got == pytest.approx(-0.4 * hidden, rel=F64)
    with pytest.raises(ValueError, match=r"pipeline_overlap must be a number in \[0, 1\], got 1.5"):
        Costs.from_json({**COSTS_JSON, "pipeline_overlap": 1.5})


def test_one_worker_is_its_tables_sole_writer_unless_others_write() -> None:
    """The cache's own work is the sole writer's calibration at one worker, the shared
    calibration with several workers or ``other_writers`` (it then asks the store about
    every row it serves); nothing else in the step changes with it."""
    costs = load_costs_dict()
    tm = TrafficModel()

    def cache_work(k: CacheCosts, tr: dict[str, TableTraffic]) -> float:
        return sum(
            k.per_table_s + k.per_id_s * t.unique + k.per_admit_s * t.returned for t in tr.values()
        )

    cache = CachePlan(fraction=0.1, read_bound=4, write_bound=4)
    one = small_plan(1).with_(cache=cache)
    tr = tm.traffic(one)
    sole = predict(one, costs, tr)
    others = predict(one.with_(cache=dataclasses.replace(cache, other_writers=True)), costs, tr)
    delta = cache_work(costs.cache_shared, tr) - cache_work(costs.cache, tr)
    assert delta > 0
    assert others.parts["compute"] == pytest.approx(sole.parts["compute"] + delta, rel=F64)
    assert others.parts["pull"] == sole.parts["pull"]
    # two workers: the shared calibration, whatever other_writers says
    two = small_plan(2).with_(cache=cache)
    tr2 = tm.traffic(two)
    as_sole = dataclasses.replace(costs, cache_shared=costs.cache)
    moved = predict(two, costs, tr2).parts["compute"] - predict(two, as_sole, tr2).parts["compute"]
    assert moved == pytest.approx(
        cache_work(costs.cache_shared, tr2) - cache_work(costs.cache, tr2), rel=1e-9
    )


def test_the_plot_says_which_network_curves_coincide() -> None:
    """Curves within 5 % of each other at every W are named in the plot (one hides the
    other), curves apart are not."""
    from hybridrec.plan.model import Prediction
    from hybridrec.plan.report import _coinciding

    def pred(w: int, net: str, rate: float) -> Prediction:
        return Prediction(workers=w, servers=1, network=net, parts={}, step_s=1.0,
                          samples_per_s=rate, bottleneck="compute")  # fmt: skip

    preds = [pred(w, n, r * w) for w in (1, 64) for n, r in (("10", 90.0), ("25", 99.0),
                                                               ("100", 100.0))]  # fmt: skip
    assert _coinciding(preds, ["10", "25", "100"]) == ["25", "100"]


@pytest.mark.timeout(300)
def test_a_quick_calibration_runs_the_job_and_writes_a_file_the_planner_reads(
    tmp_path: Path,
) -> None:
    """``--calibrate --quick --no-mpi`` times the parts and the job's steps on this
    machine (the values are this machine's, so only their form is checked here): the
    file loads, every cost is a number >= 0, both cache calibrations are there, the
    pipeline's overlap is a share, and a one-worker cached plan is predicted from it."""
    out = tmp_path / "costs.json"
    main(["--calibrate", "--quick", "--no-mpi", "--out", str(out)])
    costs = load_costs(out)
    assert costs.mpi_wire is None and costs.mpi_wire_sharded is None  # --no-mpi
    for k in (costs.cache, costs.cache_shared, *costs.embedding.values()):
        assert all(v >= 0.0 for v in dataclasses.astuple(k)), k
    assert 0.0 <= costs.pipeline_overlap <= 1.0
    plan = small_plan(1, store="inprocess", servers=0).with_(
        cache=CachePlan(fraction=0.1, read_bound=4, write_bound=4)
    )
    p = predict(plan, costs, TrafficModel().traffic(plan))
    assert p.step_s > 0 and p.hit_rate is not None
