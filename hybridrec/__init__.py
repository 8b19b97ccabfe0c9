"""hybridrec: run training jobs on the five packages (comm, ps, cache, embedding, dense).

What a user imports: the training loop, checkpoints and resume, config dataclasses and
their command line, launch roles and store selection, data readers, and the DLRM and
GPT jobs built from them.
"""
