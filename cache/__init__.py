"""cache: the worker-side hot-embedding cache (capacity, LRU/LFU eviction, read and write
staleness bounds, prefetch, statistics). Sits between ``ps`` and ``embedding``; imports only
``comm`` and ``ps``. Not implemented yet."""
