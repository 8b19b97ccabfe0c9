"""C kernels of the cache's record updates.

One kernel per pair of files: ``<name>.c`` (the C source, shipped as package data)
and ``<name>.py`` (its loader). Built on first use by :func:`comm.native.load_c_library`.

* ``records`` - serve rows from the cache slab, apply pushes, copy clocks;
* ``admit`` - evict a pull's victims and install its admitted rows in one pass;
* ``plan_pull`` - plan a sole writer's serving pull in one pass;
* ``pack_ids`` - check and pack a table group's ids into its id space;
* ``sketch`` - count ids in TinyLFU's frequency sketch and estimate them;
* ``sorted_ids`` - the ids of one sorted array not in another;
* ``victim_pool`` - the victim search, the first valid entries of TinyLFU's pool of
  victims, the keys' halving.
"""
