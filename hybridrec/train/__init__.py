"""The training loop every job shares and what it reports.

* the loop: :mod:`~hybridrec.train.loop` (:class:`Trainer`, :class:`TrainerConfig`), the
  batches it iterates (:mod:`~hybridrec.train.batches`, on the device:
  :mod:`~hybridrec.train.device_batches`), the dense math's precision
  (:mod:`~hybridrec.train.precision`) and stop requests (:mod:`~hybridrec.train.interrupts`);
* its reporting: running losses read once per report (:mod:`~hybridrec.train.loss_sums`),
  the per-step cadences (:mod:`~hybridrec.train.step_log`), the terminal's progress bar
  (:mod:`~hybridrec.train.progress_bar`), the run's metrics file and its plot
  (:mod:`~hybridrec.train.metrics_file`, :mod:`~hybridrec.train.metrics_plot`), and AUC /
  log loss (:mod:`~hybridrec.train.click_metrics`).
"""
