"""Columns computed for a dataset's rows, as the table grows: the rows a job's columns lack and the
commit that fills them in (``infer.refresh: missing``, :mod:`lance_hpc.backfill.missing`), the
indices on the columns it replaces or extends (:mod:`lance_hpc.backfill.indices`), and the run that
``job: infer`` and ``job: map`` share: pin, compute fragments on many ranks, commit once."""
