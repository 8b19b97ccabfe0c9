"""The MPI store: table shards on server ranks of an ``mpirun`` job.

* ``wire`` - the binary message layout (no pickle); imports no MPI;
* ``server`` - :func:`serve_mpi` and :class:`ServerConfig`: the loop a server rank runs;
* ``store`` - :class:`MPIStore`: the worker side, a :class:`ps.Store`.

The protocol (messages, ordering, exactly-once pushes, liveness) is described once, in
``docs/ps_protocol.md``. ``server`` and ``store`` import mpi4py (which starts MPI), so
this package imports neither until asked: ``from ps.mpi.store import MPIStore``, or
``ps.MPIStore``.
"""
