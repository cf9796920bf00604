"""Reading a mounted image's bytes: every byte fetched, verified and cached on the way.

* ``reader``: ``BlockReader``, image byte ranges for the FUSE file (memory LRU, sequential
  read-ahead, the access log that becomes a startup profile);
* ``fetcher``: ``SectorFetcher``, sectors from the node's cache or by coalesced, verified
  ranged reads of the store, with priorities, single flight, timeouts and retries;
* ``prefetch``: ``Prefetcher``, warming the cache in the background in the image's
  profile order.

May import ``snapshotter.cache``, the leaves, and imagetool's ``format``, ``errors`` and
``stores``; nothing of mount or containerd.
"""
