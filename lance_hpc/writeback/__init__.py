"""Write-back: what a model (``job: infer``) or a function (``job: map``) says about every row of a
dataset, written as new columns of it, or reported as metrics (``job: evaluate``), one fragment at a
time, one commit at the end (:mod:`~lance_hpc.writeback.steps`, the run they share), with the
columns' provenance; a refresh computes only the rows the columns lack (:mod:`lance_hpc.backfill`)
and joins them to the columns (:mod:`~lance_hpc.writeback.fill`)."""
