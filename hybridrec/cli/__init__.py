"""What a person at the command line meets: the ``hybridrec`` command
(:mod:`~hybridrec.cli.commands`), options built from config dataclasses with run files
(:mod:`~hybridrec.cli.options`), the options every job shares
(:mod:`~hybridrec.cli.job_options`), one entry point for every job
(:mod:`~hybridrec.cli.run_job`) and one-line user errors (:mod:`~hybridrec.cli.errors`).

Nothing here imports torch at module level except :mod:`~hybridrec.cli.run_job`, so
``hybridrec --help`` stays quick.
"""
