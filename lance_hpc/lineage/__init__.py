"""Where every column lance_hpc writes and every checkpoint it saves came from.

A column's provenance lives in the dataset itself, in the field metadata of the column
(:mod:`lance_hpc.lineage.provenance`): the checkpoint or function that computed it, the spec, the
dataset version it read, when, and each refresh since. A checkpoint's lineage lives in its manifest
(the dataset versions, filters and mix it was trained on, the spec). ``lance-hpc lineage`` reads
both and prints the chain (:mod:`lance_hpc.lineage.show`).
"""
