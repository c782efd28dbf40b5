"""Sharded checkpoints: the shards every rank writes (:mod:`.saver`), read back as data only
(:mod:`.reading`), the names their files may give (:mod:`.names`). Where they go is the store's
business (:mod:`lance_hpc.checkpoint.stores`)."""
