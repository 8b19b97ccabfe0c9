"""Best-epoch selection and early stopping (``TrainerConfig.best_metric``, ``mode``,
``patience``; the DLRM job's ``--keep-best`` and ``--patience``).

The reference for "the best epoch's model" is a second run of the same schedule that
simply stops at that epoch: the restored model, and the DLRM job's test metrics, must
equal it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import comm
from hybridrec.dlrm.job import DLRMJobConfig, train
from hybridrec.train.loop import Trainer, TrainerConfig, TrainResult

pytestmark = pytest.mark.numerics  # rerun under each ATEN_CPU_CAPABILITY

Batch = tuple[torch.Tensor, torch.Tensor]


def batches(steps: int = 6) -> list[Batch]:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(4, 1, generator=g)
    out = []
    for _ in range(steps):
        x = torch.randn(8, 4, generator=g)
        out.append((x, (x @ w).squeeze(1)))
    return out


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 1), nn.Flatten(0))


def fit(net: nn.Module, script: list[float], **kw: Any) -> tuple[TrainResult, Trainer]:
    """Train ``net`` with an ``evaluate()`` that reports ``script[i]`` as "score" after
    the i-th epoch row (a scripted validation curve; the model itself really trains)."""
    seen: list[int] = []

    def evaluate() -> dict[str, Any]:
        seen.append(1)
        return {"score": script[len(seen) - 1]}

    cfg = TrainerConfig(**{"progress": False, "verbose": False, "best_metric": "score", **kw})
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    trainer = Trainer(cfg, model=net, loss=F.mse_loss, optimizer=opt, data=batches(),
                      evaluate=evaluate)  # fmt: skip
    return trainer.fit(), trainer


def params(net: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize(("mode", "script"), [("max", [1, 3, 5, 4, 5, 2, 9, 9]),
                                              ("min", [9, 7, 5, 6, 5, 8, 1, 1])])  # fmt: skip
def test_stops_after_patience_epochs_and_restores_the_best(mode: str, script: list[float]) -> None:
    k, patience = 3, 2  # the score is best after epoch 3 (a tie does not improve)
    stopped, trainer = fit(model(), script, epochs=8, patience=patience, mode=mode)
    assert [r["epoch"] for r in stopped.epochs] == list(range(1, k + patience + 1))
    assert stopped.stopped_early and stopped.best is not None
    assert stopped.best["epoch"] == k and stopped.step == (k + patience) * 6
    restored = params(trainer.dense)
    folder = trainer.best_dir().parent  # no checkpoint_dir: a temporary folder, removed
    assert folder.is_dir()
    trainer.close()
    assert not folder.exists()

    reference, _ = fit(ref := model(), script, epochs=k, mode=mode)  # the run stopped at k
    for got, want in zip(restored, params(ref), strict=True):
        assert torch.equal(got, want)
    assert reference.best is not None and reference.best["epoch"] == k


def test_without_patience_the_schedule_runs_out_and_the_best_is_kept(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    result, trainer = fit(model(), [1, 5, 2, 3], epochs=4, checkpoint_dir=str(ck))
    trainer.close()
    assert [r["epoch"] for r in result.epochs] == [1, 2, 3, 4] and not result.stopped_early
    assert result.best is not None and result.best["epoch"] == 2
    assert (ck / "best" / "model.json").is_file()  # kept under the checkpoint dir
    _, ref_trainer = fit(ref := model(), [1, 5], epochs=2)
    ref_trainer.close()
    for got, want in zip(params(trainer.dense), params(ref), strict=True):
        assert torch.equal(got, want)


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="patience 2 needs best_metric"):
        TrainerConfig(patience=2)
    with pytest.raises(ValueError, match="mode must be 'max' or 'min', got 'up'"):
        TrainerConfig(best_metric="x", mode="up")
    with pytest.raises(ValueError, match="patience must be >= 0, got -1"):
        TrainerConfig(best_metric="x", patience=-1)
    with pytest.raises(ValueError, match=r"best_metric 'auc' is not in the epoch row .*'score'"):
        fit(model(), [1.0], best_metric="auc")
    with pytest.raises(ValueError, match="patience 1 needs keep_best"):
        DLRMJobConfig(patience=1, keep_best=False)


# ---------------------------------------------------------------- the DLRM job

# Small synthetic clicks with a learning rate high enough to overfit: the validation
# AUC peaks after a few epochs (measured: epoch 4 of 8) and then falls.
OVERFIT: dict[str, Any] = dict(
               data="synthetic", synthetic_samples=2_000, synthetic_rows=200, batch_size=64,
               dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1], lr=0.03, emb_lr=0.5,
               verbose=False, progress=False)  # fmt: skip


def run(**kw: Any) -> dict[str, Any]:
    return train(DLRMJobConfig(**{**OVERFIT, **kw}), comm.LocalGroup())


@pytest.mark.timeout(120)
def test_dlrm_reports_the_test_metrics_of_the_best_validation_epoch(tmp_path: Path) -> None:
    patience = 2
    stopped = run(epochs=8, patience=patience)
    vals = [r["val_auc"] for r in stopped["epochs"]]
    k = max(range(len(vals)), key=lambda i: (vals[i], -i)) + 1  # the first best epoch
    assert stopped["best_epoch"] == k and stopped["stopped_early"], vals
    assert len(vals) == k + patience < 8, vals  # it did stop early
    assert stopped["val_auc"] == vals[k - 1]

    at_k = run(epochs=k, keep_best=False)  # the reference: a run that ends at epoch k
    assert at_k["best_epoch"] is None
    # Bit for bit: up to epoch k both runs do the same steps, and the stopped run
    # evaluates a copy of epoch k's weights with the same code on the same test set.
    assert stopped["test_auc"] == at_k["test_auc"]
    assert stopped["test_logloss"] == at_k["test_logloss"]

    # Stopped by --max-steps inside epoch k + 1 and resumed: the best-so-far (epoch k)
    # comes back from the checkpoint, and the run ends as the uninterrupted one did.
    spe = stopped["epochs"][0]["steps_in_epoch"]
    ck = str(tmp_path / "ck")
    first = run(epochs=8, patience=patience, checkpoint_dir=ck, max_steps=k * spe + spe // 2)
    assert first["best_epoch"] == k and not first["stopped_early"]
    second = run(epochs=8, patience=patience, checkpoint_dir=ck, resume=True)
    assert second["best_epoch"] == k and second["stopped_early"]
    assert second["steps"] == stopped["steps"]
    # Bit for bit: a resume at the saving worker count repeats the saving run
    # (docs/numerics.md), and the best epoch's weights come back from the checkpoint.
    assert second["test_auc"] == stopped["test_auc"]
    again = run(epochs=8, patience=patience, checkpoint_dir=ck, resume=True)
    assert again["already_finished"] and again["best_epoch"] == k
    assert again["test_auc"] == stopped["test_auc"]  # the finished run's, as it was saved
