"""``hybridrec.train.loop.Trainer`` with a user's own models (neither DLRM nor GPT), each
against a plain torch loop written out by hand: the same losses step by step and the
same weights; its checkpoints resume exactly, a finished run stays finished, epoch
losses and rates count the right steps, and a resume with other shapes names them.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ps
from doc_blocks import code_after
from embedding import EmbeddingCollection, KeyedJaggedIds, TableConfig
from hybridrec.train.batches import epoch_data
from hybridrec.train.loop import Trainer, TrainerConfig, TrainResult
from tolerance import assert_close, assert_same, replay_tol

pytestmark = pytest.mark.numerics  # rerun under each ATEN_CPU_CAPABILITY

SAME_LOOP = "the trainer runs the plain loop's operations in the same order on the same tensors"
RESUMED = "a resume at the same worker count loads the saved bits and repeats the saving run"

Batch = tuple[torch.Tensor, torch.Tensor]


def regression_batches(steps: int = 12, b: int = 16) -> list[Batch]:
    """``(x [b, 4], y [b, 1])`` with y a fixed nonlinear function of x plus noise."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        x = torch.randn(b, 4, generator=g)
        y = (x[:, :1] * 2 - x[:, 1:2].abs() + 0.1 * torch.randn(b, 1, generator=g)).contiguous()
        out.append((x, y))
    return out


def regressor() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))


def plain_loop(model: nn.Module, batches: list[Batch], epochs: int) -> list[float]:
    """The reference: the textbook torch loop."""
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for _ in range(epochs):
        for x, y in batches:
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    return losses


def step_losses(path: Path) -> list[float]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "step"]


def fit(model: nn.Module, batches: list[Batch], **kw: Any) -> TrainResult:
    cfg = TrainerConfig(**{"progress": False, "log_every": 1, "samples_per_step": 16, **kw})
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    trainer = Trainer(cfg, model=model, loss=F.mse_loss, optimizer=opt, data=batches,
                      run_config={"width": 16}, shape_options=["width"])  # fmt: skip
    result = trainer.fit()
    trainer.close()
    return result


def test_own_model_equals_a_plain_torch_loop(tmp_path: Path) -> None:
    batches = regression_batches()
    ref, mine = regressor(), regressor()
    want = plain_loop(ref, batches, epochs=2)
    result = fit(mine, batches, epochs=2, metrics_out=str(tmp_path / "m.jsonl"))
    assert step_losses(tmp_path / "m.jsonl") == want  # bit for bit: the same ops in order
    for i, (a, b) in enumerate(zip(ref.parameters(), mine.parameters(), strict=True)):
        assert_same(b.detach(), a.detach(), what=f"parameter {i}", why=SAME_LOOP)
    assert want[-1] < want[0] / 2  # it learns
    # Exactly: the epoch sums are float64 additions of the same losses from zero in the
    # same order, then one division by the step count, as here.
    assert [r["train_loss"] for r in result.epochs] == [sum(want[:12]) / 12, sum(want[12:]) / 12]
    assert (result.step, result.steps_run) == (24, 24)
    # Exactly: the trainer divides the same integer by the same float.
    assert result.samples_per_s == 24 * 16 / result.train_seconds


def test_resume_is_exact_finished_stays_finished_and_shapes_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    batches = regression_batches()
    full = regressor()
    whole = fit(full, batches, epochs=2, checkpoint_dir=str(tmp_path / "a"))

    part, ck = regressor(), str(tmp_path / "b")
    first = fit(part, batches, epochs=2, max_steps=7, checkpoint_dir=ck)
    assert (first.step, first.steps_run) == (7, 7)
    resumed = regressor()  # a fresh process: everything comes from the checkpoint
    second = fit(resumed, batches, epochs=2, checkpoint_dir=ck, resume=True)
    for i, (a, b) in enumerate(zip(full.parameters(), resumed.parameters(), strict=True)):
        assert_same(b.detach(), a.detach(), what=f"resumed parameter {i}", why=RESUMED)
    # The first epoch's loss spans the steps before and after the resume: exactly, as the
    # checkpoint keeps the float64 sums (JSON writes a float's shortest repr, which reads
    # back to the same bits) and the resumed run adds the same losses in the same order.
    assert [r["epoch"] for r in second.epochs] == [1, 2]
    for got, want in zip(second.epochs, whole.epochs, strict=True):
        assert got["train_loss"] == want["train_loss"]
    # Rates: this run's 17 steps over this run's time (the same integer over the same float).
    assert (second.step, second.steps_run) == (24, 17)
    assert second.samples_per_s == 17 * 16 / second.train_seconds

    saved = sorted(p.name for p in Path(ck).iterdir())
    stamp = (Path(ck) / "latest").stat().st_mtime_ns
    capsys.readouterr()
    again = fit(regressor(), batches, epochs=2, checkpoint_dir=ck, resume=True)
    assert again.already_finished and again.steps_run == 0 and again.step == 24
    assert "already finished at step 24" in capsys.readouterr().out
    assert sorted(p.name for p in Path(ck).iterdir()) == saved  # nothing written or pruned
    assert (Path(ck) / "latest").stat().st_mtime_ns == stamp

    opt = torch.optim.Adam(regressor().parameters())
    wider = Trainer(TrainerConfig(checkpoint_dir=ck, resume=True, progress=False),
                    model=regressor(), loss=F.mse_loss, optimizer=opt, data=batches,
                    run_config={"width": 32}, shape_options=["width"])  # fmt: skip
    with pytest.raises(ValueError, match="model options differ: width: 16 in the checkpoint, 32"):
        wider.fit()


# ---------------------------------------------------------------- with an embedding table

ITEMS, DIM = 30, 8


def bag_batches(steps: int = 10, b: int = 8) -> list[tuple[KeyedJaggedIds, torch.Tensor]]:
    """Samples with 1-3 item ids; the click depends on whether item < 10 is among them."""
    g = torch.Generator().manual_seed(2)
    out = []
    for _ in range(steps):
        lengths = torch.randint(1, 4, (b,), generator=g)
        ids = torch.randint(0, ITEMS, (int(lengths.sum()),), generator=g)
        owner = torch.repeat_interleave(torch.arange(b), lengths)
        labels = torch.zeros(b).index_add_(0, owner, (ids < 10).float()).clamp(max=1)
        out.append((KeyedJaggedIds(["items"], ids, lengths), labels))
    return out


class ItemBag(nn.Module):
    """A user's recommender: a summed bag of item rows (a local hybridrec table) -> logit."""

    def __init__(self) -> None:
        super().__init__()
        table = TableConfig(name="items", num_rows=ITEMS, dim=DIM, feature_names=["items"],
                            optimizer=ps.SGD(lr=0.1))  # fmt: skip
        self.items = EmbeddingCollection([table])
        torch.manual_seed(3)
        self.head = nn.Linear(DIM, 1)

    def forward(self, kjt: KeyedJaggedIds) -> torch.Tensor:
        return self.head(self.items(kjt)["items"]).squeeze(-1)  # [B]


def test_own_model_with_an_embedding_table_equals_torch_embedding_bag(tmp_path: Path) -> None:
    batches = bag_batches()
    mine = ItemBag()
    bag = nn.EmbeddingBag(ITEMS, DIM, mode="sum")
    with torch.no_grad():
        bag.weight.copy_(mine.items.rows("items", torch.arange(ITEMS)))
    head = copy.deepcopy(mine.head)
    # The same loop in float64 measures the float32 loop's own rounding error: the trainer
    # pools and updates the rows with other kernels (another order, FMA or none), so its
    # run is within a few times that of the reference (tests/support/tolerance.py, replay_tol).
    bag64, head64 = copy.deepcopy(bag).double(), copy.deepcopy(head).double()

    def plain(bag: nn.EmbeddingBag, head: nn.Linear) -> list[float]:
        opt = torch.optim.SGD([*bag.parameters(), *head.parameters()], lr=0.1)
        losses = []
        for _ in range(2):
            for kjt, y in batches:
                offsets = torch.cumsum(kjt.lengths, 0) - kjt.lengths
                logit = head(bag(kjt.ids, offsets)).squeeze(-1)
                loss = F.binary_cross_entropy_with_logits(logit, y.to(logit.dtype))
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
        return losses

    want, want64 = plain(bag, head), plain(bag64, head64)

    cfg = TrainerConfig(epochs=2, log_every=1, progress=False, metrics_out=str(tmp_path / "m"))
    trainer = Trainer(cfg, model=mine, loss=F.binary_cross_entropy_with_logits,
                      optimizer=torch.optim.SGD(mine.head.parameters(), lr=0.1), data=batches,
                      dense=mine.head, embeddings=mine.items)  # fmt: skip
    trainer.fit()
    trainer.close()
    why = "a few times the plain loop's fp32 rounding error, measured in float64"
    ref, ref64 = torch.tensor(want), torch.tensor(want64, dtype=torch.float64)
    got = torch.tensor(step_losses(tmp_path / "m"))
    assert_close(got, ref, atol=replay_tol(ref, ref64), what="step losses", why=why)
    assert want[-1] < want[0]
    rows = mine.items.rows("items", torch.arange(ITEMS))
    for what, a, b, b64 in [
        ("rows", rows, bag.weight, bag64.weight),
        ("head weight", mine.head.weight, head.weight, head64.weight),
        ("head bias", mine.head.bias, head.bias, head64.bias),
    ]:
        b, b64 = b.detach(), b64.detach()
        assert_close(a.detach(), b, atol=replay_tol(b, b64), what=what, why=why)


def test_data_forms_and_bad_arguments() -> None:
    assert epoch_data([1, 2, 3]).steps_per_epoch == 3
    made = epoch_data(lambda epoch: iter([epoch, epoch]))
    assert made.steps_per_epoch is None
    assert [b for b, _ in made.train_batches(5, skip=1)] == [5]
    with pytest.raises(TypeError, match="expected a list of batches"):
        epoch_data(42)  # type: ignore[arg-type]
    opt = torch.optim.SGD(regressor().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="give step=, or model= and loss="):
        Trainer(TrainerConfig(), optimizer=opt, data=[])
    with pytest.raises(ValueError, match="TrainerConfig.epochs must be >= 1, got 0"):
        TrainerConfig(epochs=0)
    with pytest.raises(ValueError, match="resume needs checkpoint_dir"):
        TrainerConfig(resume=True)


# ---------------------------------------------------------------- the documented example

DOC = Path(__file__).resolve().parents[2] / "docs" / "trainer.md"
MARKER = "<!-- usage-example: tested by tests/jobs/test_trainer.py -->"


def doc_example() -> str:
    return code_after(DOC, MARKER)


@pytest.mark.timeout(120)
def test_documented_example_runs_learns_and_stays_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # it writes ckpt/ and metrics.jsonl where it runs
    code = compile(doc_example(), str(DOC), "exec")
    first: dict[str, Any] = {"__name__": "docs_example"}
    exec(code, first)  # noqa: S102 - our own doc
    result = first["result"]
    assert result.steps_run == 80 and len(result.epochs) == 5
    assert result.epochs[-1]["train_loss"] < result.epochs[0]["train_loss"] / 4
    assert (tmp_path / "metrics.png").is_file() and (tmp_path / "ckpt" / "latest").is_file()
    again: dict[str, Any] = {"__name__": "docs_example"}
    exec(code, again)  # noqa: S102
    assert again["result"].already_finished and again["result"].steps_run == 0


def test_package_names_load_their_modules_on_first_use() -> None:
    import subprocess
    import sys

    import hybridrec
    from hybridrec.checkpoint import model_state
    from hybridrec.train import loop
    from multiproc import rank_env

    assert hybridrec.save_model is model_state.save_model
    assert hybridrec.Trainer is loop.Trainer
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = hybridrec.nope  # type: ignore[attr-defined]
    code = (
        "import sys, hybridrec; sys.exit('torch' in sys.modules)"  # `hybridrec --help` stays light
    )
    assert subprocess.run([sys.executable, "-c", code], env=rank_env(), timeout=60).returncode == 0
