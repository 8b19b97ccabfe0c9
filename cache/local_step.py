"""The worker copy's own step: the table's optimizer moves a cached row between refreshes.

A cached copy is served for up to ``s_r`` of the PS's updates and gathers up to ``s_w``
local ones before they are pushed. HET moves the copy by a plain SGD step per local
update; with an adaptive optimizer that step is not the PS's (Adam moves a row by about
``lr`` per update whatever the gradient's scale, row-wise Adagrad by ``lr g / sqrt(a)``),
so a hot row would be served lagging its own updates. Here the copy takes the table's
optimizer step with the row's optimizer state, pulled with the row and kept beside it:

* **a local update** ``g``: ``(copy, state) := apply(copy, state, g)``, what the PS does
  for a push of ``g``;
* **a refresh** (or a miss read from the PS) brings the PS row and its state; a row
  with ``k`` pending updates is then advanced by them as the PS will apply them when
  they are pushed (``apply_counted`` of their sum, count and statistic where pushes are
  counted, else one ``apply`` of the sum), so it does not lose its unpushed updates.

With one worker and ``s_w = 0`` every update reaches the PS as it is applied here, so
the copy stays equal to the PS row whatever ``s_r``. With ``s_w > 0`` the copy's ``k``
separate steps and the PS's counted step differ as docs/cache.md says; the PS row
replaces the copy at its next refresh.

Tensors here are torch views or copies of the cache's rows (host records or device
rows); nothing loops over ids.
"""

from __future__ import annotations

import torch

from ps import Optimizer


class LocalStep:
    """The step of copies of a ``dim``-wide table's rows under ``optimizer``."""

    def __init__(self, optimizer: Optimizer, dim: int) -> None:
        self.optimizer = optimizer
        self.state_dim = optimizer.state_dim(dim)  # S floats of state per row

    def step(self, rows: torch.Tensor, state: torch.Tensor, grads: torch.Tensor) -> None:
        """One local update of each row, in place: ``rows`` ``[K, D]``, ``state``
        ``[K, S]``, ``grads`` ``[K, D]`` (one per row, finite)."""
        if rows.shape[0]:
            self.optimizer.apply(rows, state, grads)

    def ahead(
        self,
        rows: torch.Tensor,
        state: torch.Tensor,
        pend: torch.Tensor,
        counts: torch.Tensor,
        stats: torch.Tensor | None,
    ) -> None:
        """PS rows ``rows`` ``[K, D]`` and their state ``[K, S]``, in place, advanced by
        the pending updates ``pend`` ``[K, D]`` (sums of ``counts`` ``[K]`` updates; 0:
        none) as the PS will apply them: counted (``stats`` ``[K, Q]``) or, with
        ``stats`` None, one update of the sum."""
        sel = torch.nonzero(counts > 0).squeeze(1)  # [P]
        if sel.numel() == 0:
            return
        r, st, g = rows[sel], state[sel], pend[sel]  # copies [P, D], [P, S], [P, D]
        if stats is None:
            self.optimizer.apply(r, st, g)
        else:
            self.optimizer.apply_counted(r, st, g, counts[sel], stats[sel])
        rows[sel] = r
        state[sel] = st
