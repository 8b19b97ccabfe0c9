"""dense: dense layers and their synchronous training.

* :class:`DLRMDense` / :class:`DLRMConfig`: bottom MLP, pairwise interaction, top MLP.
* :func:`broadcast_parameters` / :func:`allreduce_gradients`: plain data parallelism
  over a ``comm.ProcessGroup``.
"""

from dense.data_parallel import allreduce_gradients, broadcast_parameters
from dense.dlrm import DLRMConfig, DLRMDense, mlp, pairwise_interaction

__all__ = [
    "DLRMConfig",
    "DLRMDense",
    "allreduce_gradients",
    "broadcast_parameters",
    "mlp",
    "pairwise_interaction",
]
