"""A dataset's derived columns as the table grows: the rows they lack (fragments appended since,
or all null), which a job with ``infer.refresh: missing`` computes, and whether its values may join
the column (:mod:`lance_hpc.backfill.missing`); the indices on the columns a write-back replaces or
extends, rebuilt or brought up to date after its commit (:mod:`lance_hpc.backfill.indices`). The
write-back itself, and the commit that fills the rows in, are :mod:`lance_hpc.writeback`'s."""
