"""Tables held in this process: the in-process store and the table engine under every server.

* ``table`` - :class:`LocalTable`, one table's rows, optimizer state and clocks as CPU
  tensors (vectorised pull / push / eviction / checkpoint parts); the in-process store
  and each MPI server shard are made of these;
* ``dynamic_index`` - the batched hash index from int64 ids to rows of a dynamic table;
* ``store`` - :class:`InProcessStore`, the embedded store and the reference every other
  store is tested against.
"""

from ps.local.store import InProcessStore
from ps.local.table import LocalTable

__all__ = ["InProcessStore", "LocalTable"]
