"""Pipeline parallelism for :class:`dense.GPT`: stages over the ``pp`` ranks, micro-batches.

:func:`split_gpt` cuts a GPT into contiguous stages of balanced block counts; stage 0
also has the position embedding (and an optional token embedding in front), the last
stage the final LayerNorm and the head. The stage modules hold the SAME tensors as the
GPT they were cut from (no copy), under the same parameter names, so a stage's
``state_dict()`` keys are the GPT's keys.

:class:`Pipeline` runs one training step of a :class:`~dense.pipeline_schedules.Schedule`
on this rank: the global batch is cut into ``m`` micro-batches along dim 0; activations
``[B/m, T, D]`` go forward and their gradients backward between neighbouring stages in
the groups of :func:`~dense.pipeline_schedules.p2p_program` (each one
``ProcessGroup.p2p_async`` call: the sends and receives of one moment of the schedule,
issued together, in an order that holds under nccl's untagged, in-order point-to-point
as well as on mpi and gloo; sends are waited at the end of the step); the last stage
computes ``loss_fn(output, targets) / m`` per micro-batch, so the gradients are those of
the mean loss over the GLOBAL batch. After ``step()`` every local parameter's ``.grad``
is what one process would get for its slice of the model, the loss is on every rank, and
stage 0's ``inputs.grad`` (or the graph upstream of ``inputs``) has the input gradient:
call the optimizer next.

Bidirectional schedule: every rank holds two stages (stage ``r`` of the down pipeline and
stage ``p-1-r`` of the up pipeline); build them with :func:`stages_for_rank`. The two
replicas of each stage start equal (cut from the same GPT) and their gradients are summed
(allreduce between the two ranks) before ``step()`` returns, so they stay equal under any
optimizer. Inputs and targets are then needed on ranks 0 and p-1 (each holds a first and a
last stage), and each of those ranks gets the input gradient of the micro-batches its pipe
carried (zero rows for the others: the two ranks' ``inputs.grad`` sum to the full one).

Tied parameters: ``tied=[{0: "embed.weight", p-1: "head.weight"}]`` names, per stage, the
parameters that are one logical tensor (GPT-2's token table tied to its head). Their
gradients are summed over every copy (every stage, every replica) so they stay equal.

Example (1F1B over the world's 4 ranks)::

    torch.manual_seed(0); gpt = GPT(cfg)              # the same init on every rank
    pipe = Pipeline(stages_for_rank(gpt, group, "1f1b"), group, microbatches=8)
    opt = torch.optim.AdamW(pipe.parameters())
    loss = pipe.step(tok_emb if rank == 0 else None, targets if rank == 3 else None)
    opt.step(); opt.zero_grad()
    pipe.last_stats.bubble                            # idle fraction of this rank's step

Dropout draws different random numbers than a one-process run (each stage has its own
generator state); with dropout 0 the run equals one process on the global batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from comm.group import P2POp, ProcessGroup
from comm.handle import Handle
from dense.gpt import GPT, gpt_loss
from dense.pipeline_schedules import (
    Action,
    Exchange,
    Message,
    Schedule,
    input_of,
    make_schedule,
    output_of,
    p2p_program,
)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class StageModule(nn.Module):
    """A contiguous slice of a GPT: ``forward(x)`` maps this stage's input to its output.

    Stage 0 takes token vectors ``[B, T, D]`` (or token ids ``[B, T]`` when it has an
    ``embed`` module) and adds the position embedding; middle stages map ``[B, T, D]`` to
    ``[B, T, D]``; the last stage returns logits ``[B, T, V]``. ``blocks`` is keyed by the
    block's index in the full GPT, so parameter names match the GPT's.
    """

    def __init__(
        self,
        gpt: GPT,
        stage: int,
        stages: int,
        layers: range,
        embed: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.stage, self.stages, self.layers = stage, stages, layers
        self.d_model = gpt.cfg.d_model
        self.block_size = gpt.cfg.block_size
        first, last = stage == 0, stage == stages - 1
        self.embed = embed if first else None
        self.pos_emb = gpt.pos_emb if first else None
        self.drop = gpt.drop if first else None
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in layers})
        self.ln_f = gpt.ln_f if last else None
        self.head = gpt.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)  # token ids [B, T] -> [B, T, D]
        if self.pos_emb is not None:
            assert self.drop is not None
            if x.dim() != 3 or x.shape[2] != self.d_model:
                raise ValueError(
                    f"pipeline stage 0: input must be [B, T, d_model={self.d_model}], "
                    f"got shape {tuple(x.shape)}"
                )
            t = x.shape[1]
            if not 0 < t <= self.block_size:
                raise ValueError(
                    f"pipeline stage 0: sequence length {t} must be in [1, block_size="
                    f"{self.block_size}]"
                )
            pos = torch.arange(t, device=x.device)  # [T]
            x = self.drop(x + self.pos_emb(pos))  # [B, T, D]
        for block in self.blocks.values():
            x = block(x)  # [B, T, D]
        if self.head is not None:
            assert self.ln_f is not None
            x = self.head(self.ln_f(x))  # [B, T, V]
        return x


def stage_layers(n_layer: int, stages: int, stage: int) -> range:
    """The block indices of ``stage``: contiguous, the first ``n_layer % stages`` stages
    one block more than the others."""
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"split_gpt: stages must be an int >= 1, got {stages!r}")
    if stages > n_layer:
        raise ValueError(
            f"split_gpt: {stages} pipeline stages but the GPT has only {n_layer} layers; "
            "expected at most one stage per layer"
        )
    if not isinstance(stage, int) or not 0 <= stage < stages:
        raise ValueError(f"split_gpt: stage must be in [0, {stages}), got {stage!r}")
    base, extra = divmod(n_layer, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def split_gpt(gpt: GPT, stages: int, stage: int, embed: nn.Module | None = None) -> StageModule:
    """Stage ``stage`` of ``gpt`` cut into ``stages`` (sharing its tensors; see the
    module docstring). ``embed`` (e.g. an ``nn.Embedding``) runs first on stage 0."""
    if not isinstance(gpt, GPT):
        raise TypeError(f"split_gpt: expected a dense.GPT, got {type(gpt).__name__}")
    layers = stage_layers(gpt.cfg.n_layer, stages, stage)
    return StageModule(gpt, stage, stages, layers, embed=embed)


def stages_for_rank(
    gpt: GPT,
    group: ProcessGroup,
    schedule: str = "1f1b",
    embed: nn.Module | None = None,
) -> list[StageModule]:
    """The stage modules rank ``group.rank`` runs under ``schedule`` over ``group``: one,
    or two (down pipe first) for the bidirectional schedule. The stages of one rank are
    different layers, so they share no tensors."""
    layout = make_schedule(schedule, group.size, 2 if schedule == "bidirectional" else 1)
    return [split_gpt(gpt, group.size, s, embed) for _, s in layout.stages_of(group.rank)]


@dataclass(slots=True)
class PipelineStats:
    """Seconds of this rank's last ``step()``.

    ``step_s`` wall time from the agreement at the start (every rank leaves it together)
    to the loss allreduce at the end (every rank leaves it together); ``busy_s`` in stage
    forwards, backwards and the loss; ``recv_wait_s`` blocked on a receive; ``sync_s`` in
    the gradient allreduce of replicas and tied parameters; ``idle_s = step_s - busy_s``:
    everything that is not compute, the pipeline bubble (waits in the schedule and at its
    ends) plus the communication the rank could not hide.
    """

    step_s: float = 0.0
    busy_s: float = 0.0
    recv_wait_s: float = 0.0
    sync_s: float = 0.0

    @property
    def idle_s(self) -> float:
        return max(0.0, self.step_s - self.busy_s)

    @property
    def bubble(self) -> float:
        """Idle fraction of the step, ``idle_s / step_s`` (compare the mean over ranks with
        (p-1)/(m+p-1) for GPipe and 1F1B, or with :func:`~dense.pipeline_schedules.simulate`).
        Under the bidirectional schedule it includes ``sync_s``, the replicas' gradient
        allreduce (and the wait for the partner rank to reach it): Chimera's price."""
        return self.idle_s / self.step_s if self.step_s > 0 else 0.0


class Pipeline:
    """Runs a pipeline schedule's forwards and backwards on this rank (module docstring).

    ``stages``: this rank's :class:`StageModule` (or any module mapping ``[b, T, width]``
    to the next stage's input), or the list from :func:`stages_for_rank` (two for the
    bidirectional schedule, down pipe first). ``group``: the ``pp`` ranks, rank ``s``
    holding stage ``s`` (of the down pipe). ``microbatches`` ``m`` must divide the batch.
    ``loss_fn(output [b, T, V], targets [b, T])`` is the mean loss of one micro-batch.
    ``tied``: per logical tensor, ``{stage: parameter name in that stage's module}``.
    ``width``: the activation width D (default: the stage module's ``d_model``).
    """

    def __init__(
        self,
        stages: nn.Module | Sequence[nn.Module],
        group: ProcessGroup,
        microbatches: int,
        schedule: str = "1f1b",
        loss_fn: LossFn = gpt_loss,
        *,
        tied: Sequence[Mapping[int, str]] = (),
        width: int | None = None,
    ) -> None:
        self.group = group
        self.schedule: Schedule = make_schedule(schedule, group.size, microbatches)
        self.m = microbatches
        self.p = group.size
        self.loss_fn = loss_fn
        # What this rank issues, actions and point-to-point groups, in order.
        self.program = p2p_program(self.schedule)[group.rank]
        # Checks that may fail on some ranks only (the modules, the tied names) are
        # agreed on before any sub-group is made, so every rank raises or none does.
        error, sync = "", None
        try:
            self._bind(stages, width, schedule)
            sync = _GradSync(self.schedule, self.modules, tied)
        except (ValueError, TypeError) as e:
            error = str(e)
        raise_on_every_rank(group, error, "Pipeline")
        assert sync is not None
        sync.connect(group)
        self._sync = sync
        self.last_stats = PipelineStats()

    def _bind(self, stages: nn.Module | Sequence[nn.Module], width: int | None, name: str) -> None:
        """This rank's modules by (pipe, stage), the activation width, dtype and device."""
        held = self.schedule.stages_of(self.group.rank)  # [(pipe, stage)]
        modules = [stages] if isinstance(stages, nn.Module) else list(stages)
        if len(modules) != len(held):
            raise ValueError(
                f"Pipeline: schedule {name!r} puts {len(held)} stage(s) "
                f"{[s for _, s in held]} on rank {self.group.rank}, got {len(modules)} module(s)"
            )
        self.modules: dict[tuple[int, int], nn.Module] = {}
        for (pipe, stage), module in zip(held, modules, strict=True):
            got = (getattr(module, "stage", stage), getattr(module, "stages", self.p))
            if got != (stage, self.p):
                raise ValueError(
                    f"Pipeline: rank {self.group.rank} must hold stage {stage} of {self.p} "
                    f"(pipe {pipe}) under schedule {name!r}, got a module of stage {got[0]} "
                    f"of {got[1]}"
                )
            self.modules[(pipe, stage)] = module
        width = width if width is not None else getattr(modules[0], "d_model", None)
        if not isinstance(width, int) or width < 1:
            raise ValueError(
                f"Pipeline: the activation width must be an int >= 1 (pass width= for a "
                f"module without d_model), got {width!r}"
            )
        self.width = width
        first_param = next((t for m in modules for t in m.parameters()), None)
        self.dtype = first_param.dtype if first_param is not None else torch.float32
        self.device = first_param.device if first_param is not None else self.group.device

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every parameter of this rank's stage modules (once each)."""
        seen: set[int] = set()
        for module in self.modules.values():
            for t in module.parameters():
                if id(t) not in seen:
                    seen.add(id(t))
                    yield t

    # ------------------------------------------------------------------ one step

    def step(
        self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Forward and backward of the whole batch; returns the mean loss (0-d, on every
        rank). ``inputs`` ``[B, T, D]`` (or token ids) on the ranks holding a first stage,
        ``targets [B, T]`` on those holding a last stage, None elsewhere. Gradients are
        accumulated into ``.grad`` (zero them between steps)."""
        batch, seq = self._agree_on_batch(inputs, targets)
        run = _StepRun(self, inputs, targets, batch // self.m, seq)
        t0 = time.perf_counter()
        run.execute()
        run.input_backward()
        t_sync = time.perf_counter()
        self._sync.allreduce()
        sync_s = time.perf_counter() - t_sync
        # Allreduce, not a broadcast: in the bidirectional schedule two ranks hold losses.
        loss = self.group.allreduce(run.loss_sum.reshape(1))[0]
        self.last_stats = PipelineStats(
            step_s=time.perf_counter() - t0,
            busy_s=run.busy_s,
            recv_wait_s=run.wait_s,
            sync_s=sync_s,
        )
        return loss

    @torch.no_grad()
    def evaluate(
        self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Forward only (validation): the whole batch down the pipe of stage ``s`` on rank
        ``s``, no micro-batches and no gradients; the mean loss (0-d float64) on every
        rank. ``inputs`` and ``targets`` where :meth:`step` takes them."""
        batch, seq = self._agree_on_batch(inputs, targets)
        rank, module = self.group.rank, self.modules[(0, self.group.rank)]
        tag = 4 * self.m  # above every tag of a step's messages
        if rank == 0:
            assert inputs is not None
            x = module(inputs)
        else:
            x = torch.empty(batch, seq, self.width, dtype=self.dtype, device=self.device)
            self.group.p2p_async([P2POp("recv", x, rank - 1, tag)])[0].wait()
            x = module(x)
        loss = torch.zeros((), dtype=torch.float64)
        if rank < self.p - 1:
            self.group.p2p_async([P2POp("send", x.contiguous(), rank + 1, tag)])[0].wait()
        else:
            assert targets is not None
            loss = self.loss_fn(x, targets).to(torch.float64)
        return self.group.allreduce(loss.reshape(1))[0]

    def _agree_on_batch(
        self, inputs: torch.Tensor | None, targets: torch.Tensor | None
    ) -> tuple[int, int]:
        """Check this rank's arguments and agree with every rank on (B, T): one small
        allgather, so a bad batch raises ``ValueError`` on every rank, not only where
        the tensor is."""
        held = [s for _, s in self.schedule.stages_of(self.group.rank)]
        error = ""
        shape = (-1, -1)
        try:
            shape = self._local_batch(inputs, targets, 0 in held, self.p - 1 in held)
        except (ValueError, TypeError) as e:
            error = str(e)
        row = torch.tensor([int(bool(error)), *shape], dtype=torch.int64)
        table = self.group.allgather(row).tolist() if self.p > 1 else [row.tolist()]
        bad = [r for r, t in enumerate(table) if t[0]]
        if bad:
            mine = f": {error}" if error else ""
            raise ValueError(f"Pipeline.step: bad inputs/targets on rank(s) {bad}{mine}")
        shapes = {(t[1], t[2]) for t in table if t[1] >= 0}
        if len(shapes) != 1:
            raise ValueError(
                f"Pipeline.step: ranks disagree on the batch shape (B, T): "
                f"{[(t[1], t[2]) for t in table]} (one per rank, -1 = no tensor)"
            )
        batch, seq = shapes.pop()
        if batch % self.m != 0:  # raised on every rank alike
            raise ValueError(
                f"Pipeline.step: batch size {batch} is not divisible by microbatches "
                f"{self.m}; expected a multiple of {self.m}"
            )
        return batch, seq

    def _local_batch(
        self,
        inputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        needs_inputs: bool,
        needs_targets: bool,
    ) -> tuple[int, int]:
        """(B, T) of the tensors this rank needs, (-1, -1) when it needs none."""
        shape: tuple[int, int] | None = None
        for name, t, needed in (
            ("inputs", inputs, needs_inputs),
            ("targets", targets, needs_targets),
        ):
            if not needed:
                continue
            if not isinstance(t, torch.Tensor) or t.dim() < 2:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else t
                where = "first" if name == "inputs" else "last"
                raise ValueError(
                    f"rank {self.group.rank} holds a {where} stage and needs {name} "
                    f"[B, T, ...], got {got!r}"
                )
            here = (int(t.shape[0]), int(t.shape[1]))
            if shape is not None and here != shape:
                raise ValueError(f"inputs [B, T] {shape} and targets {here} differ")
            shape = here
        return shape if shape is not None else (-1, -1)

    def close(self) -> None:
        """Release the sub-groups made for the gradient sums (collective over ``group``)."""
        self._sync.close()


def raise_on_every_rank(group: ProcessGroup, error: str, what: str) -> None:
    """Collective: raise ``ValueError`` on every rank if ``error`` is set on any (one small
    allgather), so a bad argument on one rank does not leave the others waiting."""
    flags = [int(bool(error))]
    if group.size > 1:
        flags = [
            int(f)
            for f in group.allgather(torch.tensor(flags, dtype=torch.int64)).flatten().tolist()
        ]
    bad = [r for r, f in enumerate(flags) if f]
    if bad:
        raise ValueError(f"{what}: bad arguments on rank(s) {bad}{': ' + error if error else ''}")


class _StepRun:
    """The state of one ``Pipeline.step`` on this rank: stored activations, outputs
    waiting for their send, posted receives, sends in flight, timings."""

    def __init__(
        self,
        pipe: Pipeline,
        inputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        b: int,
        seq: int,
    ) -> None:
        self.pipe = pipe
        self.inputs, self.targets = inputs, targets
        self.b, self.seq = b, seq
        self.stage_in: dict[tuple[int, int], torch.Tensor] = {}  # (mb, stage) -> input
        self.stage_out: dict[tuple[int, int], torch.Tensor] = {}  # (mb, stage) -> out/loss
        self.outbox: dict[Message, torch.Tensor] = {}  # made, not sent yet: [b, T, D]
        self.recvs: dict[Message, tuple[Handle, torch.Tensor]] = {}
        self.sends: list[tuple[Handle, torch.Tensor]] = []
        self.input_grads: dict[int, torch.Tensor] = {}  # mb -> grad of its input rows
        self.busy_s = self.wait_s = 0.0
        # On the stage's device: the last stage adds its losses (device tensors) in place.
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=pipe.device)

    # Tags: unique per (pipe, direction, micro-batch) within a step; every message of a
    # step completes before the step ends, so steps reuse them. nccl ignores them (the
    # program's order matches its messages there).
    def _tag(self, msg: Message) -> int:
        return (msg.pipe * 2 + int(msg.role == "grad")) * self.pipe.m + msg.mb

    def _rows(self, mb: int) -> slice:
        return slice(mb * self.b, (mb + 1) * self.b)

    def _exchange(self, ex: Exchange) -> None:
        """Issue one group of the program: its sends and receives in one call."""
        ops = []
        for op in ex.ops:
            if op.kind == "send":
                t = self.outbox.pop(op.msg)
            else:
                pipe = self.pipe
                t = torch.empty(self.b, self.seq, pipe.width, dtype=pipe.dtype, device=pipe.device)
            ops.append(P2POp(op.kind, t, op.peer, self._tag(op.msg)))  # t: [b, T, D]
        handles = self.pipe.group.p2p_async(ops)
        for op, c, handle in zip(ex.ops, ops, handles, strict=True):
            if op.kind == "send":
                self.sends.append((handle, c.tensor))
            else:
                self.recvs[op.msg] = (handle, c.tensor)

    def _received(self, a: Action) -> torch.Tensor:
        msg = input_of(a, self.pipe.p)
        assert msg is not None  # internal invariant: only called where a receives
        handle, buf = self.recvs.pop(msg)
        t0 = time.perf_counter()
        handle.wait()
        self.wait_s += time.perf_counter() - t0
        return buf

    def _made(self, t: torch.Tensor, a: Action) -> None:
        """Keep ``a``'s output ``t`` for the group that sends it."""
        msg = output_of(a, self.pipe.p)
        assert msg is not None  # internal invariant: only called where a sends
        self.outbox[msg] = t.contiguous()

    def _reap_sends(self) -> None:
        # Testing drives MPI's progress on large sends while this rank computes.
        self.sends = [(h, t) for h, t in self.sends if not h.is_completed()]

    def execute(self) -> None:
        for item in self.pipe.program:
            if isinstance(item, Exchange):
                self._exchange(item)
            elif item.kind == "F":
                self._forward(item)
            else:
                self._backward(item)
            self._reap_sends()
        for handle, _ in self.sends:
            handle.wait()
        self.sends.clear()

    def _forward(self, a: Action) -> None:
        p, module = self.pipe.p, self.pipe.modules[(a.pipe, a.stage)]
        if a.stage == 0:
            assert self.inputs is not None
            x = self.inputs[self._rows(a.mb)].detach()
            if x.is_floating_point() and self.inputs.requires_grad:
                x.requires_grad_(True)  # a leaf per micro-batch: its .grad is the input grad
        else:
            x = self._received(a).requires_grad_(True)
        t0 = time.perf_counter()
        out = module(x)
        if a.stage == p - 1:
            assert self.targets is not None
            out = self.pipe.loss_fn(out, self.targets[self._rows(a.mb)]) / self.pipe.m
            self.loss_sum += out.detach().double()
        self.busy_s += time.perf_counter() - t0
        if a.stage < p - 1:
            self._made(out.detach(), a)
        self.stage_in[(a.mb, a.stage)] = x
        self.stage_out[(a.mb, a.stage)] = out

    def _backward(self, a: Action) -> None:
        p = self.pipe.p
        x = self.stage_in.pop((a.mb, a.stage))
        out = self.stage_out.pop((a.mb, a.stage))
        grad = None if a.stage == p - 1 else self._received(a)  # [b, T, D] d loss / d out
        t0 = time.perf_counter()
        if x.requires_grad or any(t.requires_grad for t in self._params(a)):
            torch.autograd.backward(out, grad)
        self.busy_s += time.perf_counter() - t0
        if a.stage > 0:
            assert x.grad is not None
            self._made(x.grad, a)
        elif x.grad is not None:
            self.input_grads[a.mb] = x.grad

    def _params(self, a: Action) -> Iterator[nn.Parameter]:
        return self.pipe.modules[(a.pipe, a.stage)].parameters()

    def input_backward(self) -> None:
        """Hand stage 0's input gradient to ``inputs``: accumulated into ``inputs.grad``
        for a leaf, backpropagated further for a tensor computed upstream. Rows of
        micro-batches this rank did not carry are zero."""
        if self.inputs is None or not self.input_grads:
            return
        full = torch.zeros_like(self.inputs)  # [B, T, D]
        for mb, g in self.input_grads.items():
            full[self._rows(mb)] = g
        torch.autograd.backward(self.inputs, full)


class _GradSync:
    """Sums the gradients of every copy of a logical parameter: the two replicas of a
    stage in the bidirectional schedule and the tied parameters, over the ranks holding
    copies (one allreduce of a flat buffer per set of ranks)."""

    def __init__(
        self,
        schedule: Schedule,
        modules: Mapping[tuple[int, int], nn.Module],
        tied: Sequence[Mapping[int, str]],
    ) -> None:
        """Local checks and bookkeeping only; :meth:`connect` makes the sub-groups."""
        p = schedule.stages
        tie_of: dict[tuple[int, str], int] = {}
        for i, spec in enumerate(tied):
            if not isinstance(spec, Mapping) or len(spec) < 2:
                raise ValueError(
                    f"Pipeline: tied[{i}] must map at least two stages to parameter names, "
                    f"got {spec!r}"
                )
            for stage, name in spec.items():
                if not isinstance(stage, int) or not 0 <= stage < p:
                    raise ValueError(
                        f"Pipeline: tied[{i}] names stage {stage!r}; expected [0, {p})"
                    )
                if (stage, name) in tie_of:
                    raise ValueError(f"Pipeline: parameter {name!r} of stage {stage} is tied twice")
                tie_of[(stage, name)] = i

        def ranks_of(stages: Sequence[int]) -> tuple[int, ...]:
            pipes = range(schedule.pipes)
            return tuple(sorted({schedule.rank_of(pp, s) for pp in pipes for s in stages}))

        # Logical key -> this rank's copies; key -> the ranks holding a copy.
        self.copies: dict[str, list[nn.Parameter]] = {}
        key_ranks: dict[str, tuple[int, ...]] = {}
        for (_, stage), module in modules.items():
            named = dict(module.named_parameters())
            for name, param in named.items():
                if not param.requires_grad:
                    continue
                tie = tie_of.get((stage, name))
                if tie is None:
                    key, ranks = f"stage{stage}/{name}", ranks_of([stage])
                else:
                    key, ranks = f"tied{tie}", ranks_of(list(tied[tie]))
                self.copies.setdefault(key, []).append(param)
                key_ranks[key] = ranks
            for (stage_t, name), i in tie_of.items():
                if stage_t == stage and name not in named:
                    raise ValueError(
                        f"Pipeline: tied[{i}] names parameter {name!r} of stage {stage}, which "
                        f"has no such parameter (it has {sorted(named)[:6]} ...)"
                    )
        for key, params in self.copies.items():
            shapes = {tuple(t.shape) for t in params}
            if len(shapes) != 1:
                raise ValueError(f"Pipeline: the copies of {key} have different shapes {shapes}")
        self.keys_by_group: dict[tuple[int, ...], list[str]] = {}
        for key in sorted(self.copies):
            ranks = key_ranks[key]
            if len(ranks) > 1:
                self.keys_by_group.setdefault(ranks, []).append(key)
        self.local_only = [k for k in sorted(self.copies) if len(key_ranks[k]) == 1]
        # The sets of ranks that sum gradients, from the schedule and the tie list alone
        # (the same on every rank, so every rank makes the same splits in the same order).
        all_sets = {ranks_of([s]) for s in range(p)} | {ranks_of(list(t)) for t in tied}
        self.rank_sets = sorted(r for r in all_sets if len(r) > 1)
        self.groups: dict[tuple[int, ...], ProcessGroup] = {}
        self.made: list[ProcessGroup] = []  # every split's result, to close together

    def connect(self, group: ProcessGroup) -> None:
        """Collective over ``group``: one split per batch of disjoint rank sets."""
        sets = self.rank_sets
        batches: list[list[tuple[int, ...]]] = []
        for ranks in sets:
            for batch in batches:
                if all(not set(ranks) & set(other) for other in batch):
                    batch.append(ranks)
                    break
            else:
                batches.append([ranks])
        for batch in batches:
            color = next((i + 1 for i, r in enumerate(batch) if group.rank in r), 0)
            sub = group.split(color)
            self.made.append(sub)
            if color:
                self.groups[batch[color - 1]] = sub

    def allreduce(self) -> None:
        for key in self.local_only:  # several copies on this rank only (a tie within a rank)
            if len(self.copies[key]) > 1:
                self._assign(key, self._local_sum(key))
        for ranks, keys in self.keys_by_group.items():
            sums = [self._local_sum(k) for k in keys]
            flat = torch.cat([s.reshape(-1) for s in sums])
            self.groups[ranks].allreduce(flat)
            offset = 0
            for key, s in zip(keys, sums, strict=True):
                self._assign(key, flat[offset : offset + s.numel()].view_as(s))
                offset += s.numel()

    def close(self) -> None:
        for sub in self.made:
            sub.close()
        self.made.clear()
        self.groups.clear()

    def _local_sum(self, key: str) -> torch.Tensor:
        params = self.copies[key]
        total = torch.zeros_like(params[0])
        for t in params:
            if t.grad is not None:
                total += t.grad
        return total

    def _assign(self, key: str, value: torch.Tensor) -> None:
        for t in self.copies[key]:
            t.grad = value.clone()
