"""The Triton kernels (embedding/kernels) against plain torch, in Triton's CPU interpreter.

The cases live in ``tests/support/triton_cases.py`` and run in ONE subprocess with
``TRITON_INTERPRET=1`` (Triton reads it when a kernel is defined, so it cannot be
switched on inside this already-running pytest process); each case is then one
test here, and that process first checks that importing ``embedding.kernels`` does not
import triton. ``HYBRIDREC_TRITON_DEVICE=cuda`` runs the same cases compiled on a GPU.
A second subprocess compiles every kernel variant to an sm_90 cubin (no GPU needed).

Without triton the cases are skipped, unless ``HYBRIDREC_REQUIRE_TRITON=1`` (CI
sets it), in which case they fail: a silent skip must not pass CI.

The ``gpu`` tests (``make test-gpu``) run the same cases compiled on CUDA, and check
that the fused lookup's backward on CUDA (Triton, every ps optimizer) equals the CPU
path (the C kernel or the ps optimizer's ``apply``) after several steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import triton_cases
from embedding.kernels import autotune_enabled, interpreter_enabled, triton_available, use_triton
from multiproc import rank_env
from tolerance import assert_same

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "triton_cases.py"
ROOT = SCRIPT.parents[2]

# The gate benchmarks/triton_bench.py applies to its one checked step (it raises above it).
# Not a rounding tolerance: it tells a wrong update (off by about lr = 0.01 on touched
# elements) from rounding (around 1e-7 on rows of order 1 after one step); the kernels are
# checked at derived tolerances in tests/support/triton_cases.py.
BENCH_STEP_GATE = 1e-4


def _require_triton() -> None:
    if triton_available():
        return
    if os.environ.get("HYBRIDREC_REQUIRE_TRITON") == "1":
        pytest.fail("HYBRIDREC_REQUIRE_TRITON=1 but triton does not import (pip install triton)")
    pytest.skip("triton is not installed (pip install triton; the test extra has it)")


def _run_cases(*args: str, interpret: bool) -> dict[str, dict]:
    """Run triton_cases.py in a fresh process; its JSON lines by case name."""
    env = rank_env(pythonpath=(SCRIPT.parent,))
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            results[r["case"]] = r
    if not results:
        pytest.fail(f"triton_cases.py produced no results (rc {proc.returncode}):\n{proc.stderr}")
    return results


@pytest.fixture(scope="module")
def case_results() -> dict[str, dict]:
    _require_triton()
    device = os.environ.get("HYBRIDREC_TRITON_DEVICE", "cpu")
    return _run_cases("--device", device, interpret=device == "cpu")


@pytest.mark.timeout(280)
@pytest.mark.parametrize("case", sorted(triton_cases.CASES))
def test_triton_case(case_results: dict[str, dict], case: str) -> None:
    assert case in case_results, f"case {case} did not run; got {sorted(case_results)}"
    r = case_results[case]
    assert r["ok"], r["error"]


@pytest.mark.timeout(280)
def test_kernels_compile_for_sm90() -> None:
    # The interpreter runs kernels through numpy and misses what only the real compiler
    # rejects; triton's wheel bundles ptxas, so compiling to an H100/H200 cubin needs no GPU.
    _require_triton()
    results = _run_cases("--compile-arch", "90", interpret=False)
    assert len(results) == len(triton_cases.COMPILE_VARIANTS), sorted(results)
    failed = {name: r["error"] for name, r in results.items() if not r["ok"]}
    assert not failed, "\n".join(f"{n}:\n{e}" for n, e in failed.items())


def test_use_triton_needs_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.zeros(2)
    # A CPU tensor never picks Triton, not even with the interpreter on: the cases run the
    # kernels in the interpreter by calling them, the product dispatch keeps torch there.
    assert use_triton(t) is False
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert interpreter_enabled()
    assert use_triton(t) is False
    # The forward autotunes only on a GPU (the interpreter uses the fixed default config).
    assert autotune_enabled(t) is False
    monkeypatch.delenv("TRITON_INTERPRET")
    assert autotune_enabled(t) is False


def _collection_steps(steps: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """``steps`` forward + backward steps of a CPU collection with local tables (Adam and
    SGD with momentum: both reach the fused backward's dispatch): the outputs, the state."""
    import ps
    from embedding import EmbeddingCollection, KeyedJaggedIds, TableConfig

    tables = [
        TableConfig(name="a", num_rows=11, dim=4, feature_names=["a1", "a2"],
                    optimizer=ps.Adam(lr=0.05)),
        TableConfig(name="b", num_rows=7, dim=3, feature_names=["b"], pooling="mean",
                    optimizer=ps.SGD(lr=0.1, momentum=0.9)),
    ]  # fmt: skip
    coll = EmbeddingCollection(tables)
    gen = torch.Generator().manual_seed(5)
    outputs = []
    for _ in range(steps):
        lists = {
            f: [torch.randint(0, t.num_rows or 1, (int(n),), generator=gen).tolist()
                for n in torch.randint(0, 4, (3,), generator=gen)]
            for t in tables for f in t.feature_names
        }  # fmt: skip
        out = coll(KeyedJaggedIds.from_lists(lists))
        loss = sum((v * torch.randn(v.shape, generator=gen)).sum() for v in out.values())
        loss.backward()  # type: ignore[union-attr]
        outputs.extend(v.detach() for v in out.values())
    return outputs, {k: v.clone() for k, v in coll.state_dict().items()}


def test_prerequisites_name_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import embedding.kernels as kernels

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(kernels, "python_include_dir", lambda: tmp_path)
    missing = kernels.triton_prerequisites()
    assert len(missing) == 2, missing
    assert "no-such-cc" in missing[0] and "CC" in missing[0]
    assert "Python.h" in missing[1] and str(tmp_path) in missing[1]
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PATH", str(tmp_path))  # neither gcc nor clang
    assert "neither gcc nor clang" in kernels.triton_prerequisites()[0]


def test_collection_falls_back_when_triton_cannot_build(monkeypatch: pytest.MonkeyPatch) -> None:
    # A machine where the dispatch would pick Triton (a CUDA tensor, triton importing) but
    # no kernel builds, as without a C compiler: the first use probes once, warns once
    # naming the missing compiler, and the collection trains on the torch path with the
    # very results of a collection that never considered Triton.
    import embedding.kernels as kernels

    expected = _collection_steps(3)
    calls = []

    def no_compiler(device: torch.device) -> None:
        calls.append(device)
        raise RuntimeError(
            "Failed to find C compiler. Please specify via CC environment variable or set "
            "triton.knobs.build.impl."
        )  # Triton's own message (triton/runtime/build.py)

    monkeypatch.setattr(kernels, "_BUILDS", None)
    monkeypatch.setattr(kernels, "_wants_triton", lambda t: True)
    monkeypatch.setattr(kernels, "_build_probe_kernel", no_compiler)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.warns(RuntimeWarning) as record:
        outputs, state = _collection_steps(3)
    probe = [w for w in record if "cannot be built" in str(w.message)]
    assert len(probe) == 1, [str(w.message) for w in record]
    assert len(calls) == 1, "the probe runs once per process"
    message = str(probe[0].message)
    assert "CC='/nonexistent/cc' is not found" in message and "torch path" in message
    assert kernels.use_triton(torch.zeros(1)) is False
    same = "both runs take the torch path: the same operations on the same inputs"
    assert len(outputs) == len(expected[0])
    for k, (a, e) in enumerate(zip(outputs, expected[0], strict=True)):
        assert_same(a, e, what=f"output {k}", why=same)
    assert set(state) == set(expected[1])
    for key, value in state.items():
        assert_same(value, expected[1][key], what=key, why=same)


def test_probe_passes_once_and_for_all(monkeypatch: pytest.MonkeyPatch) -> None:
    import embedding.kernels as kernels

    calls = []
    monkeypatch.setattr(kernels, "_BUILDS", None)
    monkeypatch.setattr(kernels, "_build_probe_kernel", calls.append)
    assert kernels.triton_builds(torch.device("cpu")) is True
    assert kernels.triton_builds(torch.device("cpu")) is True
    assert calls == [torch.device("cpu")]


@pytest.mark.timeout(280)
def test_kernels_package_does_not_import_triton(case_results: dict[str, dict]) -> None:
    # The torch fallback must work where triton is absent: only the kernel modules import
    # it. Checked first thing in the cases' fresh process (triton is loaded here already);
    # without triton installed there is nothing it could import.
    r = case_results[triton_cases.IMPORT_CHECK]
    assert r["ok"], r["error"]


@pytest.mark.timeout(120)
def test_triton_bench_smoke_in_interpreter() -> None:
    # benchmarks/triton_bench.py end to end on CPU in the interpreter (tiny shapes): every
    # optimizer's step checked against torch's inside the run, the figures the GPU
    # benchmark reads are there and finite, and no target is claimed from interpreter times.
    _require_triton()
    env = rank_env(pythonpath=(ROOT,))
    env.pop("TRITON_INTERPRET", None)  # the script sets it itself, before importing triton
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "triton_bench.py"), "--quick", "--interpret"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["bench"] == "triton" and out["config"]["interpret"] is True
    assert out["targets"] == {}
    fig = out["figures"]
    for key in ("triton_fwd_vs_torch_min", "triton_step_vs_torch_min", "fwd_bandwidth_fraction"):
        assert isinstance(fig[key], float) and fig[key] >= 0, (key, fig[key])
    assert set(fig["step_vs_torch"]) == {"rowwise_adagrad", "adam"}  # the interpreter's two
    for name, ratios in fig["step_vs_torch"].items():
        assert set(ratios) == {"L1", "L4"}, (name, ratios)
        for tag in ratios:
            diff = fig["cases"][tag]["step"][name]["max_abs_diff_first_step"]
            assert diff <= BENCH_STEP_GATE, (name, tag, diff)


@pytest.mark.gpu
@pytest.mark.timeout(280)
def test_triton_cases_on_cuda() -> None:
    # The same cases compiled for the GPU at hand (no interpreter), references on CPU.
    _require_triton()
    results = _run_cases("--device", "cuda", interpret=False)
    failed = {name: r["error"] for name, r in results.items() if not r["ok"]}
    assert not failed, "\n".join(f"{n}:\n{e}" for n, e in failed.items())
    assert set(triton_cases.CASES) <= set(results), sorted(set(triton_cases.CASES) - set(results))


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("opt_name", sorted(triton_cases.optimizers()))
def test_fused_lookup_on_cuda_equals_cpu(opt_name: str) -> None:
    # The dispatch in embedding.fused_ops: Triton on CUDA for every optimizer, the C kernel
    # or the ps optimizer's apply on CPU; 3 steps agree within the replay tolerance of an
    # fp32 reference of the same steps against its float64 replay.
    _require_triton()
    assert use_triton(torch.zeros(1, device="cuda"))
    cpu = triton_cases.fused_lookup_steps("cpu", opt_name, 3)
    cuda = triton_cases.fused_lookup_steps("cuda", opt_name, 3)
    triton_cases.check_fused_runs_agree(cuda, cpu, opt_name, 3)
