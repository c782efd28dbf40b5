"""The node-local cache (``data.cache``): Lance data files fetched once, read from local disk after.

A process opens the cache's dataset root at its pinned version
(:mod:`lance_hpc.storage.cache.node_cache`); rows of fragments whose files are all there are read
from it, the other rows from the store, while a background thread fetches the missing fragments.
The other modules say where the files live and how each is fetched and locked
(:mod:`~lance_hpc.storage.cache.files`), under which names (:mod:`~lance_hpc.storage.cache.names`),
in which directories (:mod:`~lance_hpc.storage.cache.dirs`) and how they are evicted
(:mod:`~lance_hpc.storage.cache.eviction`).
"""
