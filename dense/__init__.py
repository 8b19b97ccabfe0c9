"""dense: dense layers and their synchronous training.

* :class:`DLRMDense` / :class:`DLRMConfig`: bottom MLP, pairwise dot interaction or a
  DCN-v2 cross network (:class:`CrossNetwork`), top MLP.
* :class:`DataParallel`: bucketed gradient averaging overlapped with backward
  (``dense.buckets`` assigns the buckets), optional ``comm.compression`` codecs.
* :class:`ZeroOptimizer`: ZeRO stage 1/2 (sharded optimizer state / gradients);
  :func:`save_zero_state` / :func:`load_zero_state` store its global state without pickle.
* :class:`GPT` / :class:`GPTConfig`: a GPT-style decoder that takes token vectors from an
  embedding collection (:func:`gpt_loss` is its cross entropy).
* :class:`Pipeline`: pipeline parallelism over ``pp`` ranks (GPipe, 1F1B, bidirectional
  schedules from ``dense.pipeline_schedules``); :func:`split_gpt` / :func:`stages_for_rank`
  cut a :class:`GPT` into its stages.
* :func:`broadcast_parameters` / :func:`allreduce_gradients`: plain data parallelism
  over a ``comm.ProcessGroup`` (no overlap).
"""

from dense.buckets import Bucket, assign_buckets
from dense.data_parallel import DataParallel, allreduce_gradients, broadcast_parameters
from dense.dcn import CrossLayer, CrossNetwork
from dense.dlrm import DLRMConfig, DLRMDense, mlp, pairwise_interaction
from dense.gpt import GPT, GPTConfig, gpt_loss
from dense.pipeline import Pipeline, PipelineStats, StageModule, split_gpt, stages_for_rank
from dense.pipeline_schedules import Action, Schedule, make_schedule, simulate
from dense.zero import ZeroOptimizer
from dense.zero import load_from_dir as load_zero_state
from dense.zero import save_to_dir as save_zero_state

__all__ = [
    "Action",
    "Bucket",
    "CrossLayer",
    "CrossNetwork",
    "DLRMConfig",
    "DLRMDense",
    "DataParallel",
    "GPT",
    "GPTConfig",
    "Pipeline",
    "PipelineStats",
    "Schedule",
    "StageModule",
    "ZeroOptimizer",
    "allreduce_gradients",
    "assign_buckets",
    "broadcast_parameters",
    "gpt_loss",
    "load_zero_state",
    "make_schedule",
    "mlp",
    "pairwise_interaction",
    "save_zero_state",
    "simulate",
    "split_gpt",
    "stages_for_rank",
]
