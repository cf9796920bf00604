"""lazyblock's node daemon: lazy mounts of block images, and containerd's proxy snapshotter.

A read of a file in a lazily mounted image travels down through the rooms of this package::

    containerd/   containerd's snapshots API (gRPC), the snapshot store, the remote-snapshot
                  handshake and the credentials of pulls; starts mounts through mount/
    mount/        one mount: its API (api), the server process that serves it (server), the
                  fork server that starts servers fast, their state and control sockets, the
                  FUSE file (fuse) and the kernel's erofs on it (kernel)
    datapath/     a byte range of the image: read (reader), fetched from the store and
                  verified (fetcher), warmed ahead of the reads (prefetch)
    cache/        the node's verified sectors on disk (sectors, entry, usage) and its
                  indexes (indexes)

and beside them, leaves every room may use: ``errors``, ``metrics``, ``config`` (every
setting, parsed once at the edge), ``systemd``, ``startup``. At the edge: ``cli`` (the
``snapshotter`` command) and ``prometheus`` (the node's metrics exporter).

Imports go one way only: cli -> containerd -> mount -> datapath -> cache -> leaves (a room
may import any room after it, never one before it), and of imagetool only ``format``,
``errors``, ``stores`` and ``registry``. ``tests/test_layering.py`` checks it. The whole
picture, with the data flow from ``imagetool convert`` to a container: docs/architecture.md.
"""
