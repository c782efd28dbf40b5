"""How a model is spread over the ranks: DDP copies, or FSDP2 shards of a model built on the meta
device and initialised where each shard lives."""
