"""Where bytes live: storage options and credentials (``options``), opening datasets
(``datasets``), read retries (``retry``), the node-local cache (``cache``), integrity checks
(``integrity``), and atomic local files (``files``). Checkpoint stores live in
:mod:`lance_hpc.checkpoint`."""
