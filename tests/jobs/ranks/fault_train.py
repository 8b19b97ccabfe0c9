"""Rank script: a small hybrid-embedding training job that checkpoints, for fault tests.

``mpirun -n 3 python fault_train.py --dir D --steps N [--ckpt-every K] [--resume]
[--step-sleep S]``: ranks 0 and 1 are workers, rank 2 is a parameter server
(``ps.MPIStore``). Each rank writes its pid to ``D/pid.<rank>`` first, so a test
can kill it.

The model: an :class:`embedding.EmbeddingCollection` with one hybrid table (two
features, sum pooling, RowWiseAdagrad in the store) and a linear head on the
pooled rows plus 4 dense features, BCE loss; the head's gradients are averaged
over the workers and applied with plain SGD (no optimizer state to save).

Determinism, so a resumed run is bit-for-bit an uninterrupted one:

* the batch of worker ``r`` at step ``s`` is a pure function of ``(s, r)``;
* worker ``r`` only uses ids in ``[r * 500, (r + 1) * 500)``, so the order in
  which the server applies the two workers' pushes of one step cannot matter;
* every push of step ``s`` is applied before any pull of step ``s + 1`` (pushes
  are waited in backward, before the head's allreduce).

Checkpoint at every ``K``-th step, into ``D/ckpt/step-<s>/``: the workers stop
(barrier), worker 0 writes ``ps/`` (``store.save``), ``head_w.npy``/``head_b.npy``
and last ``meta.json`` (written to a temporary name and renamed: a step folder
without ``meta.json`` is an unfinished checkpoint), then the workers go on
(barrier). ``--resume`` loads the newest finished one and continues after it.

Output: worker 0 prints ``rank 0: step S loss L`` (``L`` the workers' mean loss,
``repr`` of a Python float) for every step. Any exception on a worker is printed
as ``rank R: FAILED <type>: <message>`` (after asking the store whether its
servers still answer, so a worker stuck in a collective with a peer that died of
a dead server still names the server) and the rank leaves with ``os._exit(1)``:
``MPI_Finalize`` would wait for the dead rank.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import comm
import ps
from embedding import EmbeddingCollection, KeyedJaggedIds, TableConfig
from ps.mpi.server import serve_mpi
from ps.mpi.store import MPIStore

NUM_ROWS = 1000
DIM = 8
BATCH = 32
NUM_DENSE = 4
FEATURES = ["f0", "f1"]
HEAD_LR = 0.1
REQUEST_TIMEOUT_S = 3.0
COMM_TIMEOUT_S = 5.0


def batch(step: int, rank: int) -> tuple[KeyedJaggedIds, torch.Tensor, torch.Tensor]:
    """Worker ``rank``'s batch of ``step``: ids in its own half of the table."""
    gen = torch.Generator().manual_seed(7919 * step + rank)
    lengths = torch.randint(1, 4, (len(FEATURES) * BATCH,), generator=gen)  # [F * B]
    half = NUM_ROWS // 2
    ids = rank * half + torch.randint(0, half, (int(lengths.sum()),), generator=gen)  # [N]
    dense = torch.randn(BATCH, NUM_DENSE, generator=gen)  # [B, 4]
    labels = torch.randint(0, 2, (BATCH,), generator=gen).to(torch.float32)  # [B]
    return KeyedJaggedIds(FEATURES, ids, lengths), dense, labels


def latest_checkpoint(root: Path) -> tuple[int, Path] | None:
    """The newest finished checkpoint (its ``meta.json`` exists) under ``root/ckpt``."""
    best = None
    for folder in sorted((root / "ckpt").glob("step-*")):
        if (folder / "meta.json").is_file():
            best = (int(folder.name.split("-")[1]), folder)
    return best


def save(root: Path, step: int, store: MPIStore, w: torch.Tensor, b: torch.Tensor) -> None:
    folder = root / "ckpt" / f"step-{step:06d}"
    folder.mkdir(parents=True, exist_ok=True)
    store.save(folder / "ps")
    np.save(folder / "head_w.npy", w.detach().numpy(), allow_pickle=False)
    np.save(folder / "head_b.npy", b.detach().numpy(), allow_pickle=False)
    tmp = folder / "meta.json.tmp"
    tmp.write_text(json.dumps({"step": step}))
    os.replace(tmp, folder / "meta.json")


def worker(
    args: argparse.Namespace, group: comm.ProcessGroup, workers: comm.ProcessGroup, store: MPIStore
) -> None:
    root = Path(args.dir)
    spec = TableConfig(
        name="emb",
        num_rows=NUM_ROWS,
        dim=DIM,
        feature_names=FEATURES,
        placement="hybrid",
        optimizer=ps.RowWiseAdagrad(lr=0.1),
    )
    gen = torch.Generator().manual_seed(0)
    w = (0.1 * torch.randn(len(FEATURES) * DIM + NUM_DENSE, 1, generator=gen)).requires_grad_()
    b = torch.zeros(1, requires_grad=True)
    start = 1
    found = latest_checkpoint(root) if args.resume else None
    if args.resume and found is None:
        raise FileNotFoundError(f"--resume: no finished checkpoint under {root / 'ckpt'}")
    if workers.rank == 0:
        if found is not None:
            store.load(found[1] / "ps")
        else:
            store.create_table(spec.to_spec())
    workers.barrier()  # the table exists before anyone builds the collection
    if found is not None:
        step0, folder = found
        with torch.no_grad():
            w.copy_(torch.from_numpy(np.load(folder / "head_w.npy", allow_pickle=False)))
            b.copy_(torch.from_numpy(np.load(folder / "head_b.npy", allow_pickle=False)))
        start = step0 + 1
        if workers.rank == 0:
            print(f"rank 0: resumed from step {step0}", flush=True)
    ec = EmbeddingCollection([spec], store=store, group=workers, store_is_shared=True)
    for step in range(start, args.steps + 1):
        kjt, dense, labels = batch(step, workers.rank)
        pooled = ec(kjt)  # {"f0": [B, D], "f1": [B, D]}
        x = torch.cat([pooled["f0"], pooled["f1"], dense], dim=1)  # [B, 2D + 4]
        logits = (x @ w + b).squeeze(1)  # [B]
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        w.grad, b.grad = None, None
        loss.backward()  # pushes the row gradients (waited) before returning
        assert w.grad is not None and b.grad is not None
        grads = torch.cat([w.grad.flatten(), b.grad.flatten(), loss.detach().reshape(1)])
        workers.allreduce(grads, op="avg")
        with torch.no_grad():
            n = w.numel()
            w -= HEAD_LR * grads[:n].view_as(w)
            b -= HEAD_LR * grads[n : n + 1]
        if workers.rank == 0:
            print(f"rank 0: step {step} loss {float(grads[-1])!r}", flush=True)
        if args.ckpt_every and step % args.ckpt_every == 0:
            workers.barrier()
            if workers.rank == 0:
                save(root, step, store, w, b)
            workers.barrier()  # nobody pushes step + 1 before the save is done
        if args.step_sleep:
            time.sleep(args.step_sleep)
    store.close()
    print(f"rank {group.rank}: ok worker done", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--ckpt-every", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    group = comm.init("mpi", timeout_s=COMM_TIMEOUT_S)
    Path(args.dir, f"pid.{group.rank}").write_text(str(os.getpid()))
    topology = comm.Topology(world_size=group.size, num_servers=1)
    role_group = topology.role_group(group)
    if topology.role(group.rank) is comm.Role.SERVER:
        serve_mpi(group, topology)
        print(f"rank {group.rank}: ok server returned", flush=True)
        return
    store = MPIStore(group, topology, request_timeout_s=REQUEST_TIMEOUT_S)
    try:
        worker(args, group, role_group, store)
    except Exception as err:
        message = f"rank {group.rank}: FAILED {type(err).__name__}: {err}"
        if not isinstance(err, comm.CommTimeoutError) or "server rank" not in str(err):
            try:  # a collective that gave up: is it because a server died?
                store.tables()
            except Exception as probe:
                message += f" | parameter server check: {type(probe).__name__}: {probe}"
        print(message, flush=True)
        traceback.print_exc()
        os._exit(1)


if __name__ == "__main__":
    main()
