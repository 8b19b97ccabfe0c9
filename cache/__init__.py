"""cache: the worker-side hot-embedding cache (capacity, LRU/LFU eviction or TinyLFU
admission, read and write staleness bounds, prefetch, statistics). Sits between ``ps`` and
``embedding``; imports only ``comm`` and ``ps``.

``CachedStore(store, CacheConfig(...))`` is itself a :class:`ps.Store`, so an
``embedding.EmbeddingCollection`` given one trains through the cache (the "hybrid"
placement). Rules: ``docs/cache.md``; admission: ``docs/cache_admission.md``.

``CachedStore(..., device=torch.device("cuda:0"))`` keeps the cached rows in that
device's memory (a GPU worker's cache in HBM); the plan of each step stays on the host.

Modules: ``config`` (CacheConfig), ``cached_store`` (the Store wrapper),
``table_cache`` (one table's slots, fetch and write-back), ``device_rows`` (the rows and
pending sums in device tensors), ``memory`` (what a cache takes, before it exists),
``policy`` (LRU/LFU/TinyLFU eviction order), ``sketch`` (TinyLFU's count-min sketch of
recent id frequencies), ``slot_index`` (id -> slot), ``stats`` (counters and the
staleness histogram).
"""

from cache.cached_store import CachedStore
from cache.config import CacheConfig
from cache.memory import CacheBytes, cache_bytes, rows_fitting

__all__ = ["CacheBytes", "CacheConfig", "CachedStore", "cache_bytes", "rows_fitting"]
