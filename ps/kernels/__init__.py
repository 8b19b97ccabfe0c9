"""C kernels of the parameter server's CPU row updates.

One kernel per pair of files: ``<name>.c`` (the C source, shipped as package data)
and ``<name>.py`` (its loader: ctypes signatures, checks, the Python entry points).
Built on first use by :func:`comm.native.load_c_library`; callers fall back to torch
where no C compiler is present.

* ``rowwise_adagrad`` - fused row-wise Adagrad (pull/push engine of
  :class:`ps.local.LocalTable` and the CPU fused backward of ``embedding``), id sort,
  segment sums.
* ``message_pass`` - an MPI server's batched pulls and pushes of fixed tables, checked
  and served whole (:mod:`ps.mpi.batched_pass`); built after ``rowwise_adagrad.c``,
  whose row step it applies.
* ``narrow_rows`` - rows stored as fp16/bf16: stochastic rounding (the bits of
  :func:`ps.rounding.round_to`), row-wise Adagrad over them and their float32 pooling;
  built after ``rowwise_adagrad.c``, whose row step it applies to the widened row.
"""
