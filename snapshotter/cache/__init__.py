"""The node's local caches, shared by every mount and image on it.

* ``sectors``: ``SectorCache``, verified uncompressed sectors by checksum, LRU-bounded for
  the directory as a whole, safe to share between processes;
* ``entry``: the layout of one entry file (the sector, its block digests, a checked
  footer): the cache's own on-disk format;
* ``usage``: the directory's byte count that every process sharing it keeps;
* ``indexes``: image indexes by digest, so that a remount fetches no index.

May import the leaves (``snapshotter.errors``, ``metrics``, ``config``) and imagetool's
``format`` and ``errors``; nothing of datapath, mount or containerd.
"""
