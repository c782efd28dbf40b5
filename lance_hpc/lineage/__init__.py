"""Where every column lance_hpc writes and every checkpoint it saves came from, as plain documents.

A column's provenance lives in the dataset itself, in the field metadata of the column
(:mod:`lance_hpc.lineage.provenance`): the checkpoint or function that computed it, the spec, the
dataset version it read, when, and each refresh since. A checkpoint's lineage lives in its manifest
(:mod:`lance_hpc.lineage.checkpoints`: the dataset versions, filters and mix it was trained on, the
spec). Nothing here reads a store: the write-back job fills the documents
(:mod:`lance_hpc.writeback.provenance`), ``lance-hpc lineage`` reads them back and prints the chain
(:mod:`lance_hpc.manage.lineage`).
"""
