"""A job's processes and where its rows live: the world, the worker and PS-server roles and
the ``--ps`` store (:mod:`~hybridrec.launch.roles`), the cache a job's hybrid tables get
(:mod:`~hybridrec.launch.job_cache`), the tables a store kept from an earlier run
(:mod:`~hybridrec.launch.existing_tables`) and where the memory goes before anything is
allocated (:mod:`~hybridrec.launch.memory_plan`).
"""
