"""RecBole 1.2.1's own SASRec on its bundled ml-100k: the benchmark peer for our SASRec.

Protocol: all 100 000 interactions are positives (no filtering, no rating threshold);
leave-one-out by time per user (last item = test, second to last = validation, the
rest train: every prefix of a user's training sequence, capped at 50 items, is one
sample); full ranking over all items. RecBole masks only the [PAD] item: for a
sequential model ``FullSortEvalDataLoader`` yields ``history_index=None``, so
``Trainer._full_sort_batch_eval`` does not exclude the user's seen items.
Timestamp ties keep the file's row order (RecBole sorts with stable argsort).

    python benchmarks/_recbole_sasrec.py --epochs 50 --seed 0   # prints one JSON line

Runs in-process: RecBole keeps no state between calls that changes a second run
(it re-seeds everything from ``seed``, its dataloaders seed their own generators, and
its logger is never given handlers here). Nothing is written to cwd: no logger file,
no tensorboard writer, checkpoints dir in a temp dir (and the best model kept in memory).
On a 2-core CPU with threads=1 one epoch takes ~320 s at the default batch of 2048
(435 samples/s) and ~120 s at 256 (823 samples/s), + ~1 s of validation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings

PEER_PIP = (
    "pip install pandas scipy scikit-learn colorlog colorama tabulate texttable "
    "thop pyyaml psutil tensorboard tqdm"
)
KEYS = (
    "test_hr@10", "test_ndcg@10", "test_mrr@10", "test_hr@50", "test_ndcg@50",
    "val_mrr@10", "best_epoch", "epochs_run", "train_seconds", "fit_seconds",
    "train_samples_per_epoch", "train_samples_per_s", "parameters",
    "item_embedding_parameters", "users", "items", "note",
)  # fmt: skip


class _NoWriter:
    """Stands in for tensorboard's SummaryWriter, which writes log_tensorboard/ in cwd."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def _config(epochs: int, seed: int, batch_size: int, checkpoint_dir: str):
    import numpy as np
    import recbole
    from recbole.config import Config

    def compatibility_settings(self):
        # RecBole 1.2.1's version assigns np.float = np.float_ etc., and np.float_ and
        # friends are gone in numpy 2 (AttributeError). Its metrics still use np.float
        # and np.bool, so set the old aliases from names numpy 2 still has.
        for old, new in dict(
            bool=np.bool_, int=np.int_, float=np.float64, complex=np.complex128,
            object=np.object_, str=np.str_, unicode=np.str_,
        ).items():  # fmt: skip
            setattr(np, old, new)

    Config.compatibility_settings = compatibility_settings
    settings = {
        "data_path": os.path.join(os.path.dirname(recbole.__file__), "dataset_example"),
        "load_col": {"inter": ["user_id", "item_id", "timestamp"]},
        "eval_args": {
            "split": {"LS": "valid_and_test"},
            "order": "TO",
            "group_by": "user",
            "mode": "full",
        },
        "train_neg_sample_args": None,  # CE loss over all items: no negatives
        "epochs": epochs,
        "train_batch_size": batch_size,
        "learning_rate": 0.001,
        "eval_step": 1,
        "stopping_step": 10,
        "metrics": ["Hit", "NDCG", "MRR"],
        "topk": [10, 50],
        "valid_metric": "MRR@10",
        "metric_decimal_place": 6,  # RecBole rounds metrics to 4 places by default
        "seed": seed,
        "reproducibility": True,
        "use_gpu": False,
        "show_progress": False,
        "log_wandb": False,
        "checkpoint_dir": checkpoint_dir,
    }
    argv, sys.argv = sys.argv, sys.argv[:1]  # Config also parses --key=value from argv
    try:
        return Config(model="SASRec", dataset="ml-100k", config_dict=settings)
    finally:
        sys.argv = argv


def run(*, epochs: int, seed: int, batch_size: int = 2048, threads: int | None = None) -> dict:
    result = dict.fromkeys(KEYS)
    try:
        import torch

        # Importing recbole.model.sequential_recommender runs sine.py's module-level
        # torch.autograd.set_detect_anomaly(True): process-wide, it makes any training in
        # this process (ours too) slower. SASRec does not need it: undo it at once.
        anomaly = torch.is_anomaly_enabled()
        try:
            import recbole.trainer.trainer as rb_trainer
            from recbole.data import create_dataset, data_preparation
            from recbole.model.sequential_recommender import SASRec
            from recbole.utils import init_seed
        finally:
            torch.autograd.set_detect_anomaly(anomaly)
    except Exception as e:  # noqa: BLE001 - any import failure means "peer not available"
        result["note"] = f"RecBole peer unavailable ({type(e).__name__}: {e}); {PEER_PIP}"
        return result
    if threads:
        torch.set_num_threads(threads)
    # Trainer() opens a tensorboard SummaryWriter under ./log_tensorboard: write nothing.
    rb_trainer.get_tensorboard = lambda logger: _NoWriter()

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        # pandas 3 (chained fillna on columns without NaNs) and torch warn inside RecBole.
        warnings.simplefilter("ignore")
        config = _config(epochs, seed, batch_size, tmp)
        init_seed(seed, True)
        dataset = create_dataset(config)
        train_data, valid_data, test_data = data_preparation(config, dataset)
        init_seed(seed, True)
        model = SASRec(config, train_data.dataset)
        trainer = rb_trainer.Trainer(config, model)

        train_times: list[float] = []
        train_epoch = trainer._train_epoch

        def timed_train_epoch(*args, **kwargs):
            start = time.perf_counter()
            out = train_epoch(*args, **kwargs)
            train_times.append(time.perf_counter() - start)
            return out

        trainer._train_epoch = timed_train_epoch

        # Keep the best validation model in memory instead of RecBole's checkpoint file:
        # loading that needs torch.load(weights_only=False) on torch >= 2.6.
        best = {}

        def keep_best(epoch_idx, valid_score):
            if trainer.cur_step == 0:  # early_stopping just recorded a new best
                best["epoch"] = epoch_idx
                best["state"] = {k: v.clone() for k, v in model.state_dict().items()}

        start = time.perf_counter()
        trainer.fit(train_data, valid_data, saved=False, callback_fn=keep_best)
        fit_seconds = time.perf_counter() - start
        model.load_state_dict(best["state"])
        test = trainer.evaluate(test_data, load_best_model=False)

    samples = len(train_data.dataset)
    train_seconds = sum(train_times)
    result.update(
        {
            "test_hr@10": test["hit@10"],
            "test_ndcg@10": test["ndcg@10"],
            "test_mrr@10": test["mrr@10"],
            "test_hr@50": test["hit@50"],
            "test_ndcg@50": test["ndcg@50"],
            "val_mrr@10": trainer.best_valid_result["mrr@10"],
            "best_epoch": best["epoch"] + 1,
            "epochs_run": len(train_times),
            "train_seconds": round(train_seconds, 3),
            "fit_seconds": round(fit_seconds, 3),  # training + per-epoch validation
            "train_samples_per_epoch": samples,
            "train_samples_per_s": round(samples * len(train_times) / train_seconds, 1),
            "parameters": sum(p.numel() for p in model.parameters()),
            "item_embedding_parameters": model.item_embedding.weight.numel(),
            "users": dataset.user_num - 1,  # RecBole's counts include a [PAD] id
            "items": dataset.item_num - 1,
        }
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    result = run(
        epochs=args.epochs, seed=args.seed, batch_size=args.batch_size, threads=args.threads
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
