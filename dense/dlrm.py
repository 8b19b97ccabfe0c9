"""The dense part of DLRM (Naumov et al., 2019) as a plain ``nn.Module``.

Data flow for a batch of ``B`` samples with ``F = num_sparse`` pooled embeddings
of width ``D = embedding_dim``::

    dense [B, num_dense] --bottom MLP--> x [B, D]
    sparse F x [B, D]  ----------------------------.
    stack(x, sparse...)                        -> T [B, F+1, D]
    T @ T^T                                    -> Z [B, F+1, F+1]
    strictly lower triangle of Z               -> P [B, (F+1)F/2]
    cat(x, P)                                  -> [B, D + (F+1)F/2]
    top MLP                                    -> logits [B]

With ``interaction="dcn"`` the dot products are replaced by DCN-v2's low-rank cross
network (:mod:`dense.dcn`)::

    cat(x, sparse...)                          -> x0 [B, (F+1)D]
    dcn_layers cross layers of rank dcn_rank   -> [B, (F+1)D]
    top MLP                                    -> logits [B]

The embeddings themselves live elsewhere (``embedding/``); this module only sees
their pooled ``[B, D]`` outputs, so it imports nothing but torch. Distribution
(data parallelism, ZeRO) wraps it from outside (``dense.data_parallel``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dense.dcn import CrossNetwork
from dense.kernels import interaction as interaction_kernel

INTERACTIONS = ("dot", "dcn")


@dataclass(kw_only=True, slots=True)
class DLRMConfig:
    """Shape of the dense DLRM.

    ``bottom_mlp`` lists the output widths of the bottom MLP's layers; the last must
    equal ``embedding_dim`` so its output can interact with the embeddings.
    ``top_mlp`` lists the top MLP's output widths; the last must be 1 (the logit).
    Every layer is listed, the last included: ``bottom_mlp=[64, 16]`` is two layers,
    13 -> 64 -> 16 for 13 dense features (the DLRM job's ``--bottom-mlp`` and
    ``--top-mlp`` mean the same).

    ``interaction``: ``"dot"`` (pairwise dot products, DLRM's) or ``"dcn"`` (DCN-v2's
    low-rank cross network of ``dcn_layers`` layers of rank ``dcn_rank``; both are
    ignored by ``"dot"``).
    """

    num_dense: int
    num_sparse: int
    embedding_dim: int
    bottom_mlp: list[int] = field(default_factory=lambda: [64, 16])
    top_mlp: list[int] = field(default_factory=lambda: [64, 1])
    interaction: str = "dot"
    dcn_layers: int = 3
    dcn_rank: int = 64

    def __post_init__(self) -> None:
        if self.interaction not in INTERACTIONS:
            raise ValueError(
                f"DLRMConfig.interaction must be one of {INTERACTIONS}, got {self.interaction!r}"
            )
        for name in ("num_dense", "num_sparse", "embedding_dim", "dcn_layers", "dcn_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DLRMConfig.{name} must be an int >= 1, got {value!r}")
        for name in ("bottom_mlp", "top_mlp"):
            widths = list(getattr(self, name))
            if not widths or any(not isinstance(w, int) or w < 1 for w in widths):
                raise ValueError(
                    f"DLRMConfig.{name} must be a non-empty list of ints >= 1, got {widths!r}"
                )
            setattr(self, name, widths)
        if self.bottom_mlp[-1] != self.embedding_dim:
            raise ValueError(
                f"DLRMConfig: the bottom MLP's last width ({self.bottom_mlp[-1]}, "
                f"bottom_mlp={self.bottom_mlp}) must equal embedding_dim "
                f"({self.embedding_dim}) so it can interact with the embeddings"
            )
        if self.top_mlp[-1] != 1:
            raise ValueError(
                f"DLRMConfig: the top MLP's last width must be 1 (one logit per sample), "
                f"got {self.top_mlp[-1]} (top_mlp={self.top_mlp})"
            )

    @property
    def num_interactions(self) -> int:
        """Pairs among the bottom output and the F embeddings: ``(F+1)F/2``."""
        n = self.num_sparse + 1
        return n * (n - 1) // 2

    @property
    def num_features(self) -> int:
        """The bottom MLP's output and the F embeddings: ``F+1`` vectors of width D."""
        return self.num_sparse + 1

    @property
    def top_input_dim(self) -> int:
        """dot: ``D + (F+1)F/2`` (x and the pairs); dcn: ``(F+1)D`` (the cross output)."""
        if self.interaction == "dcn":
            return self.num_features * self.embedding_dim
        return self.embedding_dim + self.num_interactions


# Input widths of the first layers are padded to a multiple of this many floats (one
# AVX2 register). MKL's sgemm is markedly slower on odd inner dimensions: on the
# 2-core AVX2 box, the backward GEMMs of the 415 -> 512 top layer take ~1.5x as long
# as those of 416 -> 512, and 13 -> 512 ~1.6x as long as 16 -> 512 (docs/dlrm_bench.md).
_ALIGN = 8


def _aligned(width: int) -> int:
    return -(-width // _ALIGN) * _ALIGN


class AlignedLinear(nn.Linear):
    """``nn.Linear`` that multiplies with its inputs padded to an aligned width.

    The parameters are exactly those of ``nn.Linear(in_features, out_features)``
    (same shapes, same state dict); ``forward`` accepts ``[B, in_features]`` or an
    input already padded with zero columns to ``[B, padded_in]``, and computes with
    the weight zero-padded to ``[out, padded_in]``. Padded columns contribute exact
    zeros, so the result equals ``nn.Linear``'s up to summation order; the gradient
    of the padding is dropped by the pad's backward.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features)
        self.padded_in = _aligned(in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = self.padded_in - self.in_features
        if pad == 0:
            return F.linear(x, self.weight, self.bias)
        if x.shape[-1] == self.in_features:
            x = F.pad(x, (0, pad))  # [B, padded_in]
        return F.linear(x, F.pad(self.weight, (0, pad)), self.bias)


def mlp(
    in_dim: int, widths: Sequence[int], *, last_activation: bool, align_input: bool = False
) -> nn.Sequential:
    """Linear layers of the given output widths with ReLU between them.

    Init follows the DLRM reference: weights ~ N(0, sqrt(2 / (fan_in + fan_out))),
    biases ~ N(0, sqrt(1 / fan_out)), which keeps activations of order one.
    ``align_input`` makes the first layer an :class:`AlignedLinear` (same
    parameters), which also accepts its input pre-padded to ``padded_in`` columns.
    ReLUs work in place: the Linear before them does not need its output for backward.
    """
    layers: list[nn.Module] = []
    prev = in_dim
    for i, width in enumerate(widths):
        linear = AlignedLinear(prev, width) if align_input and i == 0 else nn.Linear(prev, width)
        with torch.no_grad():
            linear.weight.normal_(0.0, math.sqrt(2.0 / (prev + width)))
            linear.bias.normal_(0.0, math.sqrt(1.0 / width))
        layers.append(linear)
        if i < len(widths) - 1 or last_activation:
            layers.append(nn.ReLU(inplace=True))
        prev = width
    return nn.Sequential(*layers)


@functools.lru_cache(maxsize=16)
def _pair_indices(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices into a row-major ``[N, N]`` matrix, built once per ``(N, device)``
    (a copy per step to a GPU would be a host synchronisation).

    ``pairs [P]``: ``i * N + j`` for the strictly lower triangle ``i > j`` in
    row-major order, ``P = N(N-1)/2``. ``sym [N * N]``: for entry ``(i, j)`` the
    position in ``pairs`` of ``(max(i, j), min(i, j))``, and ``P`` on the diagonal
    (which the backward maps to a zero column).
    """
    rows, cols = torch.tril_indices(n, n, offset=-1)
    pairs = rows * n + cols  # [P]
    pos = torch.full((n, n), pairs.numel(), dtype=torch.int64)
    pos[rows, cols] = torch.arange(pairs.numel())
    pos[cols, rows] = torch.arange(pairs.numel())
    return pairs.to(device), pos.reshape(-1).to(device)


class _Interaction(torch.autograd.Function):
    """``[B, N, D] -> [B, (D if with_first) + P + pad]``: optionally the first
    feature vector, then the strictly-lower-triangle dot products, then zero
    columns up to ``width``.

    Forward: one ``bmm`` for the Gram matrix and one ``index_select`` of its lower
    triangle (no advanced indexing, whose backward is a slow accumulating
    ``index_put``). Backward: ``Z = T T^T`` gives ``dT = (G + G^T) T``, built as a
    symmetric ``G`` by one gather from the pair gradients and multiplied in ONE
    ``bmm`` (autograd's would take two plus the ``index_put``).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        t: torch.Tensor,
        pairs: torch.Tensor,
        sym: torch.Tensor,
        with_first: bool,
        width: int,
    ) -> torch.Tensor:
        ctx.with_first = with_first
        ctx.num_pairs = pairs.numel()
        ctx.kernel = interaction_kernel.usable(t)
        if ctx.kernel:  # float32 on CPU: the C kernel (pairs only, one sample in L1)
            t = t.contiguous()
            ctx.save_for_backward(t, sym)
            return interaction_kernel.forward(t, with_first=with_first, width=width)
        b, n, d = t.shape
        z = torch.bmm(t, t.transpose(1, 2)).view(b, n * n)  # [B, N*N]
        parts = [t[:, 0]] if with_first else []  # [B, D]
        parts.append(z.index_select(1, pairs))  # [B, P]
        used = (d if with_first else 0) + pairs.numel()
        if width > used:
            parts.append(t.new_zeros(b, width - used))  # [B, pad]
        ctx.save_for_backward(t, sym)
        return torch.cat(parts, dim=1)  # [B, width]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        t, sym = ctx.saved_tensors
        if ctx.kernel:
            return interaction_kernel.backward(t, grad, with_first=ctx.with_first), *[None] * 4
        b, n, d = t.shape
        first = d if ctx.with_first else 0
        g_pairs = grad[:, first : first + ctx.num_pairs]  # [B, P]
        g_ext = torch.cat([g_pairs, grad.new_zeros(b, 1)], dim=1)  # [B, P+1]; P is the diagonal
        g_sym = g_ext.index_select(1, sym).view(b, n, n)  # [B, N, N], symmetric
        g_t = torch.bmm(g_sym, t)  # [B, N, D]
        if ctx.with_first:
            g_t[:, 0] += grad[:, :d]
        return g_t, None, None, None, None


class _InteractionRows(torch.autograd.Function):
    """:class:`_Interaction` (with the first vector) of N separate ``[B, D]`` float32
    CPU tensors, read in place by the C kernel: no ``[B, N, D]`` stack is built in the
    forward. The backward's ``[B, N, D]`` gradient is handed out as N views."""

    @staticmethod
    def forward(ctx: Any, width: int, *rows: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        rows = tuple(r.contiguous() for r in rows)
        ctx.save_for_backward(*rows)
        return interaction_kernel.forward(rows, with_first=True, width=width)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows = ctx.saved_tensors
        g_t = interaction_kernel.backward(list(rows), grad, with_first=True)  # [B, N, D]
        return None, *g_t.unbind(1)


def _interact(t: torch.Tensor, *, with_first: bool, width: int) -> torch.Tensor:
    # Traced (torch.export, torch.compile), the indices are built inside the trace: its
    # tensors are fake ones, which the cache would hand to later real calls.
    build = _pair_indices.__wrapped__ if torch.compiler.is_compiling() else _pair_indices
    pairs, sym = build(t.shape[1], t.device)
    out: torch.Tensor = _Interaction.apply(t, pairs, sym, with_first, width)
    return out


def pairwise_interaction(features: torch.Tensor) -> torch.Tensor:
    """Dot products of every pair of distinct feature vectors.

    ``features`` is ``[B, N, D]``; the result is ``[B, N(N-1)/2]``, the strictly
    lower triangle of ``features @ features^T`` in row-major order: pairs
    (1,0), (2,0), (2,1), (3,0), ...
    """
    if features.dim() != 3:
        raise ValueError(
            f"pairwise_interaction expects [B, N, D], got shape {tuple(features.shape)}"
        )
    n = features.shape[1]
    return _interact(features, with_first=False, width=n * (n - 1) // 2)


Pooled = Sequence[torch.Tensor] | torch.Tensor  # [B, D] per sparse feature, or [B, F, D]


class DLRMDense(nn.Module):
    """Bottom MLP, interaction (pairwise dot products or a DCN-v2 cross network) and
    top MLP of DLRM.

    ``forward(dense, sparse)`` takes dense features ``[B, num_dense]`` and the
    pooled embeddings, either a list of ``num_sparse`` tensors ``[B, D]`` or one
    ``[B, num_sparse, D]`` tensor, and returns logits ``[B]``. ``sparse`` may also be
    a function returning them, called once the bottom MLP has run (TorchRec's DLRM
    order: dense arch, then sparse arch). Autograd runs the ready node created last
    first, so the embeddings' backward then runs right after the interaction's,
    before the bottom MLP's: a sparse step handed to a background thread there
    (hybrid tables' push) overlaps the bottom MLP's backward, and the next
    forward's wait for it overlaps the next bottom MLP.

    Speed (the forward is the same function as the data flow above): the bottom
    output and the embeddings are copied once into ``T [B, F+1, D]``; the
    interaction writes ``x``, the pairs and the zero padding of the top MLP's
    aligned input in one ``[B, top_padded]`` tensor; its backward is one ``bmm``.
    """

    def __init__(self, config: DLRMConfig) -> None:
        super().__init__()
        self.config = config
        self.bottom = mlp(
            config.num_dense, config.bottom_mlp, last_activation=True, align_input=True
        )
        self.top = mlp(
            config.top_input_dim, config.top_mlp, last_activation=False, align_input=True
        )
        self.cross: CrossNetwork | None = None
        if config.interaction == "dcn":
            self.cross = CrossNetwork(config.top_input_dim, config.dcn_layers, config.dcn_rank)

    def forward(
        self,
        dense: torch.Tensor,
        sparse: Sequence[torch.Tensor] | torch.Tensor | Callable[[], Pooled],
    ) -> torch.Tensor:
        cfg = self.config
        if dense.dim() != 2 or dense.shape[1] != cfg.num_dense:
            raise ValueError(
                f"DLRMDense: dense features must be [B, {cfg.num_dense}], "
                f"got shape {tuple(dense.shape)}"
            )
        batch = dense.shape[0]
        if callable(sparse):
            x = self.bottom(dense)  # [B, D]
            parts = self._check_sparse(sparse(), batch)  # created after the bottom MLP
        else:
            parts = self._check_sparse(sparse, batch)  # before any compute: fail fast
            x = self.bottom(dense)  # [B, D]
        if self.cross is not None:
            if isinstance(parts, torch.Tensor):
                x0 = torch.cat([x, parts.reshape(batch, -1)], dim=1)  # [B, (F+1)D]
            else:
                x0 = torch.cat([x, *parts], dim=1)  # [B, (F+1)D]
            return self.top(self.cross(x0)).squeeze(1)  # [B]
        top0 = self.top[0]
        width = top0.padded_in if isinstance(top0, AlignedLinear) else cfg.top_input_dim
        if not isinstance(parts, torch.Tensor) and all(
            interaction_kernel.usable(p) for p in [x, *parts]
        ):
            out: torch.Tensor = _InteractionRows.apply(width, x, *parts)  # [B, top_padded]
            return self.top(out).squeeze(1)  # [B]
        if isinstance(parts, torch.Tensor):
            t = torch.cat([x.unsqueeze(1), parts], dim=1)  # [B, F+1, D]
        else:
            t = torch.stack([x, *parts], dim=1)  # [B, F+1, D], one copy
        top_in = _interact(t, with_first=True, width=width)  # [B, D + (F+1)F/2 + pad]
        return self.top(top_in).squeeze(1)  # [B]

    def _check_sparse(
        self, sparse: Sequence[torch.Tensor] | torch.Tensor, batch: int
    ) -> torch.Tensor | list[torch.Tensor]:
        cfg = self.config
        want = (batch, cfg.num_sparse, cfg.embedding_dim)
        if isinstance(sparse, torch.Tensor):
            if tuple(sparse.shape) != want:
                raise ValueError(
                    f"DLRMDense: sparse must be [B, num_sparse, D] = {list(want)}, "
                    f"got shape {tuple(sparse.shape)}"
                )
            return sparse
        parts = list(sparse)
        if len(parts) != cfg.num_sparse:
            raise ValueError(
                f"DLRMDense: expected {cfg.num_sparse} pooled embeddings, got {len(parts)}"
            )
        for i, p in enumerate(parts):
            if tuple(p.shape) != (batch, cfg.embedding_dim):
                raise ValueError(
                    f"DLRMDense: pooled embedding {i} must be [B, D] = "
                    f"[{batch}, {cfg.embedding_dim}], got shape {tuple(p.shape)}"
                )
        return parts
