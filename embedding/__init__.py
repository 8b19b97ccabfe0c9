"""embedding: what a model author touches for sparse features.

Quick use::

    import torch
    from embedding import EmbeddingCollection, KeyedJaggedIds, RowWiseAdagrad, TableConfig

    ec = EmbeddingCollection([
        TableConfig(name="items", num_rows=1000, dim=16, feature_names=["clicked", "bought"],
                    pooling="sum", optimizer=RowWiseAdagrad(lr=0.05)),          # local, fused
        TableConfig(name="words", num_rows=500, dim=16, feature_names=["title"],
                    pooling="none", placement="hybrid"),                        # in a ps store
    ])
    kjt = KeyedJaggedIds.from_lists({
        "clicked": [[1, 2], []], "bought": [[3], [3, 4]], "title": [[5, 6, 7], [8, 9, 9]],
    })
    out = ec(kjt)        # {"clicked": [2, 16], "bought": [2, 16], "title": [2, 3, 16]}
    loss = sum(o.sum() for o in out.values())
    loss.backward()      # the touched rows are updated here, by each table's optimizer

See ``docs/embedding.md``.
"""

from embedding.collection import EmbeddingCollection
from embedding.config import TableConfig
from embedding.jagged import JaggedIds, KeyedJaggedIds
from embedding.ngram import NGramConfig, ngram_ids
from ps.optimizers import FTRL, SGD, Adagrad, Adam, RowWiseAdagrad

__all__ = [
    "FTRL",
    "SGD",
    "Adagrad",
    "Adam",
    "EmbeddingCollection",
    "JaggedIds",
    "KeyedJaggedIds",
    "NGramConfig",
    "RowWiseAdagrad",
    "TableConfig",
    "ngram_ids",
]
