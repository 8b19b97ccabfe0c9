"""The Redis store: tables in Redis (or Redis Cluster) hashes, updated by Lua scripts.

One module per job:

* ``conn`` - connections: RESP encoding, one pipeline per node, cluster slots and
  redirections, timeouts and the errors that name the address;
* ``lua`` - the Lua scripts (optimizers generated per table, conditional pulls,
  eviction, snapshots, exactly-once records);
* ``layout`` - the key layout, a table's metadata and its client-side view;
* ``eviction`` - age and LRU eviction of dynamic tables;
* ``snapshot`` - checkpoint reads (bucket snapshots) and writes (row loading);
* ``store`` - :class:`RedisStore`, the :class:`ps.Store` on top of them (requests,
  retries, exactly-once sequencing).

The protocol (exactly-once pushes, retries, incarnation tokens) is described once, in
``docs/ps_protocol.md``. Importing this package imports nothing of redis-py; use
``from ps.redis.store import RedisStore`` or ``ps.RedisStore``.
"""
