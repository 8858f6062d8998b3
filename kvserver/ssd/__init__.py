"""The SSD tier's building blocks, below the daemon's orchestration (kvserver/daemon/tiering.py).

- ``format``: the on-disk format (every constant, the chunk header, checksums); docs/ssd_format.md
- ``fileio``: the OS interface (the fault-injection seam) and page-aligned buffers
- ``store``: slot files: batched chunk I/O, O_DIRECT or buffered
- ``directory``: the directory's own files (lock, FORMAT, the O_DIRECT probe, namespaces)
- ``scan``: rebuild by header scan (one header per slot holding data)
- ``index``: which chunk is in which slot, slot allocation, byte accounting, eviction (pure)
- ``space``: the index's slots that no entry holds, their states, what goes back to the disk
- ``buffers``: the bounded staging / read buffer pool
- ``config``: the tier's settings and counters

Only ``store``, ``directory``, ``scan`` and ``fileio`` touch the filesystem; ``index``,
``space`` and the policies never do.
"""
