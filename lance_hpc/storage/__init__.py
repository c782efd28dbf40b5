"""Where bytes live: storage options and credentials (``options``), opening datasets
(``datasets``), read retries (``retry``), the node-local cache (``cache``), integrity checks
(``integrity``), checkpoint stores and their index (``checkpoint_store``, ``checkpoint_index``),
and atomic local files (``files``)."""
