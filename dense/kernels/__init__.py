"""C kernels of the dense models.

One kernel per pair of files: ``<name>.c`` (the C source, shipped as package data)
and ``<name>.py`` (its loader). Built on first use by :func:`comm.native.load_c_library`.

* ``interaction`` - the DLRM pairwise dot-product interaction, forward and backward.
"""
