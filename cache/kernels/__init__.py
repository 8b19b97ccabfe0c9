"""C kernels of the cache's record updates.

One kernel per pair of files: ``<name>.c`` (the C source, shipped as package data)
and ``<name>.py`` (its loader). Built on first use by :func:`comm.native.load_c_library`.

* ``records`` - serve rows from the cache slab, apply pushes, copy clocks.
"""
