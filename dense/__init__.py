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
* Tensor parallelism over a ``tp`` group: :func:`apply_tensor_parallel` converts a
  :class:`GPT` in place (:class:`ColumnParallelLinear` / :class:`RowParallelLinear`,
  attention split by heads, :class:`VocabParallelHead`); :func:`tp_gpt_loss` /
  :func:`vocab_parallel_cross_entropy` never gather the full logits;
  :class:`VocabParallelEmbedding` is a token table split by vocabulary rows;
  :class:`TPStats` counts the allreduced bytes; :func:`tp_full_state_dict` gathers the
  full shapes back.
* :class:`Pipeline`: pipeline parallelism over ``pp`` ranks (GPipe, 1F1B, bidirectional
  schedules from ``dense.pipeline_schedules``); :func:`split_gpt` / :func:`stages_for_rank`
  cut a :class:`GPT` into its stages.
* :func:`broadcast_parameters` / :func:`allreduce_gradients`: plain data parallelism
  over a ``comm.ProcessGroup`` (no overlap).
* :class:`SASRec` / :class:`SASRecConfig`, :class:`HSTU` / :class:`HSTUConfig`: sequential
  recommendation encoders over jagged sequences of item vectors from an embedding collection.
"""

from dense.buckets import Bucket, assign_buckets
from dense.data_parallel import DataParallel, allreduce_gradients, broadcast_parameters
from dense.dcn import CrossLayer, CrossNetwork
from dense.dlrm import DLRMConfig, DLRMDense, mlp, pairwise_interaction
from dense.gpt import GPT, GPTConfig, gpt_loss
from dense.hstu import HSTU, HSTUConfig
from dense.pipeline import Pipeline, PipelineStats, StageModule, split_gpt, stages_for_rank
from dense.pipeline_schedules import Action, Schedule, make_schedule, simulate
from dense.sasrec import SASRec, SASRecConfig
from dense.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPStats,
    VocabParallelHead,
    apply_tensor_parallel,
    tp_full_state_dict,
    tp_stats,
)
from dense.vocab_parallel import VocabParallelEmbedding, tp_gpt_loss, vocab_parallel_cross_entropy
from dense.zero import ZeroOptimizer
from dense.zero import load_from_dir as load_zero_state
from dense.zero import save_to_dir as save_zero_state
from dense.zero3 import Zero3

__all__ = [
    "Action",
    "Bucket",
    "ColumnParallelLinear",
    "CrossLayer",
    "CrossNetwork",
    "DLRMConfig",
    "DLRMDense",
    "DataParallel",
    "GPT",
    "GPTConfig",
    "RowParallelLinear",
    "TPStats",
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "Pipeline",
    "PipelineStats",
    "Schedule",
    "StageModule",
    "Zero3",
    "ZeroOptimizer",
    "allreduce_gradients",
    "apply_tensor_parallel",
    "assign_buckets",
    "broadcast_parameters",
    "gpt_loss",
    "load_zero_state",
    "make_schedule",
    "mlp",
    "pairwise_interaction",
    "save_zero_state",
    "tp_full_state_dict",
    "tp_gpt_loss",
    "tp_stats",
    "vocab_parallel_cross_entropy",
    "simulate",
    "split_gpt",
    "stages_for_rank",
    "HSTU",
    "HSTUConfig",
    "SASRec",
    "SASRecConfig",
]
