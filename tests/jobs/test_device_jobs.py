"""Both jobs on a device: ``--device`` and ``--precision``, the batch feed, lazy losses.

The CPU variants run everywhere; the ``gpu`` ones need CUDA (``make test-gpu``): the DLRM
and LM jobs train 100 steps on the GPU and learn, and their losses match the CPU run
(fp32 within float summation order; bf16 within a stated tolerance), and two ranks
sharing one GPU over gloo equal one rank on the global batch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import comm
from embedding import KeyedJaggedIds
from hybridrec.dlrm.job import parse_args as dlrm_args
from hybridrec.dlrm.job import train as train_dlrm
from hybridrec.lm.job import parse_args as lm_args
from hybridrec.lm.job import train as train_lm
from hybridrec.train.device_batches import DeviceBatches, DeviceEpochData, to_device
from hybridrec.train.loss_sums import LossSums
from multiproc import ROOT, free_port, rank_env

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
NO_CUDA = not comm.cuda_available()
DLRM_ARGS = [
    "--data", "synthetic", "--synthetic-rows", "200", "--synthetic-samples", "20000",
    "--batch-size", "128", "--dim", "8", "--bottom-mlp", "16", "8", "--top-mlp", "16", "1",
    "--no-progress", "--no-verbose", "--backend", "local", "--log-every", "10",
]  # fmt: skip
LM_ARGS = [
    "--max-bytes", "200000", "--block-size", "32", "--batch-size", "16", "--n-layer", "1",
    "--n-head", "2", "--d-model", "32", "--eval-batches", "2", "--no-progress",
    "--no-verbose", "--backend", "local", "--tokenizer", "byte",
]  # fmt: skip


# ---------------------------------------------------------------- the device decision


@pytest.mark.skipif(not NO_CUDA, reason="checks the error where torch sees no CUDA")
def test_cuda_without_cuda_is_a_clear_error() -> None:
    for asked in ("cuda", "cuda:1"):
        with pytest.raises(RuntimeError, match=f"device '{asked}' asked for, but torch sees no"):
            comm.resolve_device(asked)
    assert comm.resolve_device("auto") == torch.device("cpu")
    with pytest.raises(RuntimeError, match="sees no CUDA"):
        train_dlrm(
            dlrm_args([*DLRM_ARGS, "--device", "cuda", "--max-steps", "1"]), comm.LocalGroup()
        )


def test_device_choices_are_checked() -> None:
    assert comm.resolve_device("CPU") == torch.device("cpu")
    with pytest.raises(ValueError, match="expected one of"):
        comm.resolve_device("tpu")
    with pytest.raises(ValueError, match="--device must be auto, cpu, cuda or cuda:N, got 'gpu'"):
        dlrm_args(["--device", "gpu"])
    with pytest.raises(ValueError, match="invalid choice: 'fp16'"):
        lm_args(["--precision", "fp16"])


@dataclass
class _NcclLike:
    """Stands for a group that holds a GPU (what an nccl TorchGroup reports)."""

    device: torch.device


def test_an_nccl_group_decides_and_refuses_cpu() -> None:
    gpu = torch.device("cuda", 3)
    assert comm.worker_device("auto", _NcclLike(gpu)) == gpu  # type: ignore[arg-type]
    assert comm.worker_device("cuda", _NcclLike(gpu)) == gpu  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nccl moves CUDA tensors only"):
        comm.worker_device("cpu", _NcclLike(gpu))  # type: ignore[arg-type]


# ---------------------------------------------------------------- the batch feed


@dataclass
class _Batch:
    dense: torch.Tensor
    sparse: KeyedJaggedIds
    labels: torch.Tensor


def _batches(n: int) -> list[tuple[_Batch, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        kjt = KeyedJaggedIds(["a", "b"], torch.randint(0, 9, (7,), generator=g),
                             torch.tensor([1, 2, 0, 3, 1, 0]))  # fmt: skip
        out.append((_Batch(torch.randn(3, 4, generator=g), kjt, torch.rand(3, generator=g)),
                    torch.tensor([i])))  # fmt: skip
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sparse_on_host", [False, True])
def test_feed_moves_every_batch_unchanged(device: str, sparse_on_host: bool) -> None:
    dev = torch.device(device)
    feed = DeviceBatches(dev, sparse_on_host=sparse_on_host)
    host = _batches(5)
    got = list(feed.batches(iter(host), pairs=True))
    assert len(got) == 5
    for (want, pos), (b, p) in zip(host, got, strict=True):
        assert torch.equal(p, pos)  # data positions stay host tensors
        assert b.dense.device.type == dev.type and b.labels.device.type == dev.type
        assert b.sparse.ids.device.type == ("cpu" if sparse_on_host else dev.type)
        assert torch.equal(b.dense.cpu(), want.dense) and torch.equal(b.labels.cpu(), want.labels)
        assert torch.equal(b.sparse.ids.cpu(), want.sparse.ids)
        assert torch.equal(b.sparse.lengths.cpu(), want.sparse.lengths)
        assert b.sparse.keys == want.sparse.keys
    if dev.type == "cpu":  # nothing copied on the host
        assert got[0][0] is host[0][0]


def test_epoch_data_wrapper_keeps_the_schedule() -> None:
    class Data:
        steps_per_epoch = 3

        def train_batches(self, epoch: int, skip: int = 0, start: Any = None) -> Any:
            return iter(_batches(3)[skip:])

    wrapped = DeviceEpochData(Data(), DeviceBatches(torch.device("cpu")))
    assert wrapped.steps_per_epoch == 3
    assert [int(p) for _, p in wrapped.train_batches(0, skip=1)] == [1, 2]


def test_to_device_maps_nested_batches() -> None:
    x = {"a": (torch.ones(2), [torch.zeros(1)]), "n": 3}
    y = to_device(x, torch.device("cpu"))
    assert y["n"] == 3 and torch.equal(y["a"][1][0], torch.zeros(1))


@pytest.mark.parametrize("device", DEVICES)
def test_loss_sums_read_device_losses_once(device: str) -> None:
    sums = LossSums()
    assert not sums
    values = [0.5, 0.25, 2.0]
    for v in values:
        sums.add(torch.tensor(v, device=device))
    sums.add(1.0)
    assert sums
    assert sums.value().tolist() == [sum(values) + 1.0, 4.0]
    sums.reset()
    assert sums.value().tolist() == [0.0, 0.0]


# ---------------------------------------------------------------- the jobs


def _dlrm(device: str, precision: str, steps: int) -> dict[str, Any]:
    argv = [*DLRM_ARGS, "--device", device, "--precision", precision, "--max-steps", str(steps)]
    return train_dlrm(dlrm_args(argv), comm.LocalGroup())


def _lm(device: str, precision: str, steps: int, placement: str) -> dict[str, Any]:
    argv = [*LM_ARGS, "--device", device, "--precision", precision, "--max-steps", str(steps),
            "--eval-every", str(steps), "--placement", placement]  # fmt: skip
    return train_lm(lm_args(argv), comm.LocalGroup())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_dlrm_trains_in_each_precision_on_cpu(precision: str) -> None:
    out = _dlrm("cpu", precision, 30)
    assert out["device"] == "cpu" and out["steps"] == 30
    assert out["test_auc"] > 0.6, out  # the synthetic labels are learnable


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_dlrm_learns_on_cuda_like_on_cpu(precision: str) -> None:
    gpu = _dlrm("cuda", precision, 100)
    cpu = _dlrm("cpu", precision, 100)
    assert gpu["device"].startswith("cuda")
    assert gpu["test_auc"] > 0.6, gpu
    # fp32: the same math up to float summation order; bf16: the dense matmuls round to
    # 8 bits of mantissa on both, differently (CPU and CUDA kernels): AUC within 0.02.
    tol = 2e-3 if precision == "fp32" else 2e-2
    assert gpu["test_auc"] == pytest.approx(cpu["test_auc"], abs=tol)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("placement", ["local", "hybrid"])
def test_lm_learns_on_cuda(placement: str) -> None:
    out = _lm("cuda", "bf16", 100, placement)
    evals = out["evals"]
    assert out["device"].startswith("cuda")
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.5, evals


@pytest.mark.timeout(120)
def test_lm_on_cpu_in_bf16_learns() -> None:
    out = _lm("cpu", "bf16", 30, "local")
    assert out["evals"][-1]["val_loss"] < out["evals"][0]["val_loss"], out["evals"]


@pytest.mark.gpu
@pytest.mark.timeout(400)
def test_two_ranks_sharing_one_gpu_over_gloo_equal_one_rank(tmp_path: Path) -> None:
    """torchrun, gloo, ``--device cuda`` with one visible GPU: both ranks train on it,
    on their halves of the same global batches, and report the one-rank losses."""
    args = [*DLRM_ARGS, "--max-steps", "40", "--device", "cuda"]
    args[args.index("--backend") + 1] = "gloo"

    def run(n: int, out: Path) -> list[dict[str, Any]]:
        # torchrun as a module: its script need not sit beside this python (a system
        # python on the GPU machine keeps scripts elsewhere).
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n),
               "--master-port", str(free_port()), str(ROOT / "examples" / "train_dlrm.py"),
               *args, "--metrics-out", str(out)]  # fmt: skip
        env = rank_env()
        env["CUDA_VISIBLE_DEVICES"] = "0"  # one GPU for both ranks
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
        return [json.loads(line) for line in out.read_text().splitlines()]

    one, two = run(1, tmp_path / "one.jsonl"), run(2, tmp_path / "two.jsonl")
    losses = [[r["loss"] for r in rows if r["kind"] == "step"] for rows in (one, two)]
    assert len(losses[0]) == 4
    assert losses[1] == pytest.approx(losses[0], abs=1e-5)
    assert two[-1]["test_auc"] == pytest.approx(one[-1]["test_auc"], abs=1e-5)
