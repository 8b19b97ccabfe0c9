"""benchmarks/gpu_bench.py stays runnable: its CPU smoke mode (``--device cpu --tiny``) in a
subprocess, checked against the output convention of benchmarks/README.md and against
figures recomputed here (the GPT's parameter count from its shape, MFU and the DLRM ratio
from the measured times, the cache part's ratios and hit rates from its times and
counts, the distinct rows of its batches with numpy). The GPU figures themselves come
from ``benchmarks/gpu_check.sh``.
"""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from multiproc import rank_env
from tolerance import assert_close, sum_tol

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_bench.py"
TARGETS = {
    "triton_fwd_vs_torch_min": 1.0,
    "triton_step_vs_torch_min": 2.0,
    "fwd_bandwidth_fraction": 0.6,
    "dlrm_gpu_vs_torch": 2.0,
    "gpt_mfu": 0.35,
    "gpu_cache_vs_local": 0.5,
    "gpu_cache_vs_uncached": 2.0,
}


# The report rounds step times to 3 decimals of a millisecond and target values to 4
# decimals (round()), so a figure recomputed from a rounded one carries half a unit of
# that decimal, besides float64's own roundings.
MS_HALF_UNIT = 0.5e-3
VALUE_HALF_UNIT = 0.5e-4


def rate_from_ms(batch: int, ms: float) -> tuple[float, float]:
    """``batch / (ms / 1e3)`` and how far the report's rate (from the unrounded time) may
    be from it: the time is within half a unit of ``ms``, so the rate within
    rate * h / (ms - h) relative, plus a few float64 roundings."""
    rate = batch / (ms / 1e3)
    return rate, rate * MS_HALF_UNIT / (ms - MS_HALF_UNIT) + sum_tol(torch.float64, 4, rate)


def gpt_parameters(vocab: int, layers: int, d: int, block: int) -> int:
    """GPT-2 shaped decoder with biases, untied head, no token table."""
    per_block = (
        2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    )
    return block * d + layers * per_block + 2 * d + d * vocab


@pytest.mark.timeout(180)
def test_tiny_cpu_run_reports_every_target(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--out", str(tmp_path)],
        env=rank_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(out) >= {"bench", "machine", "config", "figures", "targets", "errors"}
    assert out["errors"] == {}, out["errors"]
    assert out["machine"]["device"] == "cpu" and out["machine"]["torch"] == torch.__version__

    check_targets(out)
    check_gpu_cache(out["figures"]["gpu_cache"], out["targets"], out["config"]["gpu_cache"])
    check_dlrm_and_gpt(out)
    check_kernels(out)

    # Partial results were written as the parts finished, the final object beside them.
    parts = [json.loads(line)["part"] for line in (tmp_path / "gpu_bench_parts.jsonl").open()]
    assert parts == ["kernels", "dlrm.fp32", "dlrm.bf16", "dlrm", "gpt", "gpu_cache"]
    assert json.loads((tmp_path / "gpu_bench.json").read_text()) == out


def run_bench(*args: str) -> dict:
    """``gpu_bench.py --device cpu --tiny *args`` in a subprocess: its last line's JSON."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", *args],
        env=rank_env(), cwd=ROOT, capture_output=True, text=True, timeout=170,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["errors"] == {}, out["errors"]
    return out


def check_targets(out: dict) -> None:
    """Every target of the issue, with value, target and met consistent; a missing value
    says why."""
    assert set(out["targets"]) == set(TARGETS)
    for name, t in out["targets"].items():
        assert t["target"] == TARGETS[name], name
        assert t["met"] == (t["value"] is not None and t["value"] >= t["target"]), name
        if t["value"] is None:
            assert t.get("note"), f"{name}: a missing value says why"


def check_kernels(out: dict) -> None:
    """Kernels: measured in Triton's interpreter where triton imports, else skipped with
    why; the targets are the part's figures, rounded."""
    k = out["figures"]["kernels"]
    if "skipped" in k:
        return
    for name in ("triton_fwd_vs_torch_min", "triton_step_vs_torch_min"):
        tol = VALUE_HALF_UNIT + sum_tol(torch.float64, 1, abs(k[name]))
        assert_close(out["targets"][name]["value"], k[name], atol=tol, what=name,
                     why="the value rounded to 4 decimals")  # fmt: skip
    # The figure of the step target is row-wise Adagrad's, the worse of the poolings.
    worst = min(k["step_vs_torch"]["rowwise_adagrad"].values())
    assert abs(k["triton_step_vs_torch_min"] - worst) <= 0.5e-3 + sum_tol(torch.float64, 1, worst)


@pytest.mark.timeout(180)
def test_headline_first_then_the_rest(tmp_path: Path) -> None:
    # --headline: the kernel, DLRM and GPT targets alone (the kernels' row-wise Adagrad
    # step only), the cache targets missing with the reason; --after-headline: the rest,
    # with the headline's DLRM and GPT parts taken over as they were.
    head = run_bench("--headline", "--out", str(tmp_path))
    assert head["config"]["run"] == "headline"
    check_dlrm_and_gpt(head)
    check_kernels(head)
    check_targets(head)
    k = head["figures"]["kernels"]
    if "skipped" not in k:
        assert set(k["step_vs_torch"]) == {"rowwise_adagrad"}
        assert set(k["cases"]) == {"L1", "L4"}  # the interpreter's poolings
    for name in ("dlrm_gpu_vs_torch", "gpt_mfu"):
        assert head["targets"][name]["value"] is not None, name
    for name in ("gpu_cache_vs_local", "gpu_cache_vs_uncached"):
        assert head["targets"][name]["value"] is None
        assert "--after-headline" in head["targets"][name]["note"]
    parts = [
        json.loads(line)["part"] for line in (tmp_path / "gpu_bench_headline_parts.jsonl").open()
    ]
    assert parts == ["kernels", "dlrm.fp32", "dlrm.bf16", "dlrm", "gpt"]
    assert json.loads((tmp_path / "gpu_bench_headline.json").read_text()) == head

    rest = run_bench("--after-headline", "--out", str(tmp_path))
    assert rest["config"]["run"] == "after-headline"
    check_targets(rest)
    check_kernels(rest)
    check_dlrm_and_gpt(rest)
    check_gpu_cache(rest["figures"]["gpu_cache"], rest["targets"], rest["config"]["gpu_cache"])
    for name in ("dlrm", "gpt"):
        taken = dict(rest["figures"][name])
        assert taken.pop("measured_by") == "--headline"
        assert taken == head["figures"][name], name
        assert rest["config"][name] == head["config"][name], name
    for name in ("dlrm_gpu_vs_torch", "gpt_mfu"):
        assert rest["targets"][name] == head["targets"][name], name
    parts = [json.loads(line)["part"] for line in (tmp_path / "gpu_bench_parts.jsonl").open()]
    assert parts == ["kernels", "gpu_cache"]


CHECK = ROOT / "benchmarks" / "gpu_check.sh"


def check_plan(env: dict[str, str]) -> tuple[int, list[tuple[str, str, int]]]:
    """``GPU_CHECK_PLAN=1 bash gpu_check.sh``: the total and (part, kind, cap) in order."""
    proc = subprocess.run(
        ["bash", str(CHECK)], env={**rank_env(), **env, "GPU_CHECK_PLAN": "1"},
        cwd=ROOT, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    total = int(re.fullmatch(r"total (\d+)s; default parts: .*", lines[0]).group(1))  # type: ignore[union-attr]
    plan = []
    for line in lines[1:]:
        m = re.fullmatch(r"part (\w+) (cap|rest, at least) (\d+)s", line)
        assert m, line
        plan.append((m.group(1), m.group(2), int(m.group(3))))
    return total, plan


def test_gpu_check_fits_its_total_with_the_headline_first() -> None:
    # The default run: the machine check, then the headline figures, and caps that sum
    # within the total (a rest part counts its reserved minimum), so the whole check fits
    # by construction; `jobs` alone fits too. The budget comment adds up the same caps.
    assert subprocess.run(["bash", "-n", str(CHECK)], timeout=30).returncode == 0
    total, plan = check_plan({})
    names = [p for p, _, _ in plan]
    assert names[:2] == ["machine", "headline"], names
    assert set(names) == {"machine", "headline", "cases", "gpu_tests", "bench"}
    assert sum(cap for _, _, cap in plan) <= total
    assert [k for _, k, _ in plan].count("rest, at least") == 1 and plan[-1][0] == "bench"
    jobs_total, jobs = check_plan({"GPU_CHECK_PARTS": "jobs"})
    assert [p for p, _, _ in jobs] == ["machine", "jobs"]
    assert sum(cap for _, _, cap in jobs) <= jobs_total == total
    source = CHECK.read_text()
    summed = " + ".join(str(cap) for _, _, cap in plan)
    assert f"#   {summed} = {sum(cap for _, _, cap in plan)} <= TOTAL = {total}" in source
    # The parts run in the order the plan lists them.
    calls = re.findall(r"^\s*run_part (\w+) ", source, flags=re.M)
    assert calls == ["machine", "headline", "cases", "gpu_tests", "bench", "jobs"], calls


def check_dlrm_and_gpt(out: dict) -> None:
    """The DLRM and GPT figures and targets of a run, recomputed from its times and shape."""
    figures = out["figures"]
    # DLRM: the target is the worse precision's ratio of the measured step times.
    dlrm = figures["dlrm"]
    ratios = {
        p: dlrm[p]["ms_step"]["torch"] / dlrm[p]["ms_step"]["hybridrec"] for p in ("fp32", "bf16")
    }
    # Each rounded time is within h of the measured one: each ratio within
    # ratio * (h / (t_torch - h) + h / (t_hybridrec - h)), their minimum within the larger
    # of those, and the value rounded to 4 decimals.
    h = MS_HALF_UNIT
    drift = max(
        ratios[p] * sum(h / (dlrm[p]["ms_step"][k] - h) for k in ("torch", "hybridrec"))
        for p in ratios
    )
    worst = min(ratios.values())
    tol = drift + VALUE_HALF_UNIT + sum_tol(torch.float64, 4, worst)
    assert_close(out["targets"]["dlrm_gpu_vs_torch"]["value"], worst, atol=tol,
                 what="dlrm_gpu_vs_torch", why="from times rounded to 1e-3 ms")  # fmt: skip
    batch = out["config"]["dlrm"]["batch"]
    for p in ("fp32", "bf16"):
        expect, tol = rate_from_ms(batch, dlrm[p]["ms_step"]["hybridrec"])
        why = "from a time rounded to 1e-3 ms"
        assert_close(figures["dlrm_gpu_samples_s"][p], expect, atol=tol,
                     what=f"dlrm_gpu_samples_s {p}", why=why)  # fmt: skip

    # GPT: parameters from the shape, MFU from the formula and the H200 bf16 peak.
    g, shape = figures["gpt"], out["config"]["gpt"]
    n = gpt_parameters(shape["vocab"], shape["n_layer"], shape["d_model"], shape["block"])
    assert g["dense_params"] == n
    flops = 6 * n + 12 * shape["n_layer"] * shape["d_model"] * shape["block"]
    # The same product and quotient of exact integers and the same float (json keeps its
    # bits); two roundings each way should the order differ.
    mfu = flops * g["tokens_s"] / 989e12
    assert_close(g["mfu"], mfu, atol=sum_tol(torch.float64, 2, mfu), what="mfu",
                 why="two float64 roundings")  # fmt: skip
    assert "989" in shape["peak"] and "scaled_dot_product_attention" in shape["attention"]


def check_gpu_cache(c: dict, targets: dict, config: dict) -> None:
    """The cache part (run on the CPU tensor path at tiny shapes): every variant timed,
    ratios and rates recomputed from the measured times and counts, the distinct rows of
    the Zipf batches recomputed here with numpy."""
    assert "error" not in c, c.get("where")
    cached = [f"cached_r{r}_w{w}" for r, w in config["bounds"]]
    assert cached == ["cached_r0_w0", "cached_r4_w4"]
    names = ["local", "uncached", *cached]
    assert set(c["samples_s"]) == set(c["ms_step"]) == set(names)
    batch = config["model"]["batch"]
    for n in names:
        assert c["samples_s"][n] > 0
        expect, tol = rate_from_ms(batch, c["ms_step"][n])
        assert_close(c["samples_s"][n], expect, atol=tol, what=f"samples_s {n}",
                     why="from a time rounded to 1e-3 ms")  # fmt: skip
        assert c["warmup"][n]["steps"] >= 1
        assert set(c["memory"][n]) >= {"host_GiB"}
    assert c["timed"]["windows"] >= 1 and c["timed"]["steps"] >= 1
    sps = c["samples_s"]
    best = max(cached, key=lambda n: sps[n])
    assert c["targets_read"] == best
    for n in cached:
        # Bit for bit: the same division of the same floats (json keeps their bits).
        assert c["vs_local"][n] == sps[n] / sps["local"]
        assert c["vs_uncached"][n] == sps[n] / sps["uncached"]
        counts = c["cache_counts_per_step"][n]
        assert 0.0 <= c["hit_rate"][n] <= 1.0
        assert counts["lookups"] > 0
        # The bench divides the integer totals (one rounding); the per-step counts are
        # each divided by the steps first, so three roundings here.
        rate = counts["hits"] / counts["lookups"]
        assert_close(c["hit_rate"][n], rate, atol=sum_tol(torch.float64, 3, rate),
                     what=f"hit_rate {n}", why="a quotient of per-step counts")  # fmt: skip
        moved = counts["rows_pulled"] + counts["rows_pushed"]
        assert_close(c["rows_moved_per_step"][n], moved, atol=sum_tol(torch.float64, 3, moved),
                     what=f"rows_moved_per_step {n}", why="a sum of per-step counts")  # fmt: skip
        assert moved > 0
        assert c["memory"][n]["device_cache_GiB"] >= 0
        assert 0 < c["warmup"][n]["steps"] <= config["warm_max"]
    # bounds (4, 4) keep rows between pushes: fewer rows moved than at bounds (0, 0)
    assert c["rows_moved_per_step"]["cached_r4_w4"] < c["rows_moved_per_step"]["cached_r0_w0"]
    assert c["hit_rate"]["cached_r4_w4"] > 0
    for name, per in (("gpu_cache_vs_local", "vs_local"), ("gpu_cache_vs_uncached", "vs_uncached")):
        tol = VALUE_HALF_UNIT + sum_tol(torch.float64, 1, abs(c[per][best]))
        assert_close(targets[name]["value"], c[per][best], atol=tol, what=name,
                     why="the value rounded to 4 decimals")  # fmt: skip
        assert targets[name]["value"] > 0 and best in targets[name]["note"]
    assert c["cache_device"] == "cpu"  # the device cache's tensor path, on the host
    # The uncached step moves every distinct row of its batch twice (pull and push);
    # the distinct rows of the first batches, from the bench's generator, with numpy.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_bench
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    shape = gpu_bench.DLRMShape(**{**config["model"], "n_batches": c["batches_drawn"]})
    drawn = gpu_bench.zipf_batches(shape, torch.device("cpu"), seed=1)
    distinct = [sum(len(np.unique(t.numpy())) for t in b.ids) for b in drawn[:4]]
    # Bit for bit: both are the correctly rounded mean of a few small integers
    # (statistics.mean exactly, numpy from their exact float64 sum and one division).
    assert c["distinct_rows_per_batch"] == float(np.mean(distinct))
    assert 0 < c["rows_moved_per_step"]["uncached"] <= 2 * config["model"]["tables"] * batch


def test_kernel_entry_point_exists() -> None:
    """gpu_bench calls ``triton_bench.run_kernels(device, quick)`` (``interpret=True`` on
    the CPU)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import triton_bench
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    inspect.signature(triton_bench.run_kernels).bind(torch.device("cpu"), True)
    inspect.signature(triton_bench.run_kernels).bind(torch.device("cpu"), True, interpret=True)
