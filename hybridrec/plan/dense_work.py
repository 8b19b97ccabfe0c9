"""The work of a DLRM dense model per sample, as the planner counts it."""

from __future__ import annotations

from dense import DLRMConfig, DLRMDense


def dense_work(config: DLRMConfig) -> tuple[float, int]:
    """``(forward + backward FLOPs per sample, parameters)`` of a ``dense.DLRMConfig``:
    every weight matrix costs 2 FLOPs per entry forward and 4 backward; the dot
    interaction ``(F+1)^2 D`` multiply-adds forward and twice that backward."""
    model = DLRMDense(config)
    params = sum(p.numel() for p in model.parameters())
    matrix = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    flops = 6.0 * matrix
    if config.interaction == "dot":
        n = config.num_sparse + 1
        flops += 6.0 * n * n * config.embedding_dim
    return flops, int(params)
