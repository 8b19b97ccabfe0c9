"""dense: dense layers and their synchronous training.

* :class:`DLRMDense` / :class:`DLRMConfig`: bottom MLP, pairwise dot interaction or a
  DCN-v2 cross network (:class:`CrossNetwork`), top MLP.
* :class:`DataParallel`: bucketed gradient averaging overlapped with backward
  (``dense.buckets`` assigns the buckets), optional ``comm.compression`` codecs.
* :class:`ZeroOptimizer`: ZeRO stage 1/2 (sharded optimizer state / gradients);
  :func:`save_zero_state` / :func:`load_zero_state` store its global state without pickle.
* :class:`Zero3`: ZeRO stage 3 (parameters, gradients and optimizer state sharded; each
  unit's parameters gathered just before its forward and backward, freed after); its
  optimizer state has the same global form as :class:`ZeroOptimizer`'s.
* :class:`GPT` / :class:`GPTConfig`: a GPT-style decoder that takes token vectors from an
  embedding collection (:func:`gpt_loss` is its cross entropy).
* :func:`broadcast_parameters` / :func:`allreduce_gradients`: plain data parallelism
  over a ``comm.ProcessGroup`` (no overlap).
"""

from dense.buckets import Bucket, assign_buckets
from dense.data_parallel import DataParallel, allreduce_gradients, broadcast_parameters
from dense.dcn import CrossLayer, CrossNetwork
from dense.dlrm import DLRMConfig, DLRMDense, mlp, pairwise_interaction
from dense.gpt import GPT, GPTConfig, gpt_loss
from dense.zero import ZeroOptimizer
from dense.zero import load_from_dir as load_zero_state
from dense.zero import save_to_dir as save_zero_state
from dense.zero3 import Zero3

__all__ = [
    "Bucket",
    "CrossLayer",
    "CrossNetwork",
    "DLRMConfig",
    "DLRMDense",
    "DataParallel",
    "GPT",
    "GPTConfig",
    "Zero3",
    "ZeroOptimizer",
    "allreduce_gradients",
    "assign_buckets",
    "broadcast_parameters",
    "gpt_loss",
    "load_zero_state",
    "mlp",
    "pairwise_interaction",
    "save_zero_state",
]
