"""Saved state, no pickle anywhere: one whole model (:mod:`~hybridrec.checkpoint.model_state`:
``save_model`` / ``load_model``), a resumable run around it
(:mod:`~hybridrec.checkpoint.run_checkpoint`: step, data position, RNG, rotation), and the
folder format both write (:mod:`~hybridrec.checkpoint.state_folder`: a JSON skeleton and
one ``.npy`` per tensor).
"""
