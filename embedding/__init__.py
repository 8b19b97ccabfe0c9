"""embedding: what a model author touches for sparse features.

Quick use::

    import torch
    from embedding import EmbeddingCollection, KeyedJaggedIds, RowWiseAdagrad, TableConfig

    ec = EmbeddingCollection([
        TableConfig(name="items", num_rows=1000, dim=16, feature_names=["clicked", "bought"],
                    pooling="sum", optimizer=RowWiseAdagrad(lr=0.05)),
    ])
    kjt = KeyedJaggedIds.from_lists({"clicked": [[1, 2], []], "bought": [[3], [3, 4]]})
    pooled = ec(kjt)                       # {"clicked": [2, 16], "bought": [2, 16]}
    loss = sum(p.sum() for p in pooled.values())
    loss.backward()                        # row gradients are pushed; the store updates rows
"""

from embedding.collection import EmbeddingCollection
from embedding.config import TableConfig
from embedding.jagged import JaggedIds, KeyedJaggedIds
from ps.optimizers import SGD, RowWiseAdagrad

__all__ = [
    "SGD",
    "EmbeddingCollection",
    "JaggedIds",
    "KeyedJaggedIds",
    "RowWiseAdagrad",
    "TableConfig",
]
