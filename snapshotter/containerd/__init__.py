"""containerd's proxy snapshotter: the ``snapshotter serve`` daemon, and the lazy pull.

* ``daemon``: the daemon from start to stop (restarts leave mounts alive);
* ``service``: containerd's snapshots API over gRPC, translated to the store;
* ``snapshots``: ``SnapshotStore``, snapshot metadata in SQLite, overlayfs layers;
* ``layers``: which Prepare names a lazyblock layer (containerd's labels, the manifest);
* ``handshake``: committing that layer as a remote snapshot so containerd skips its
  download, and remounting what a reboot or a killed server lost;
* ``mounter``: mounting those images through ``snapshotter.mount``, with credentials;
* ``pull``: ``snapshotter pull``, a lazy pull for ctr users: containerd's client steps
  (content, Prepare with the labels above, image record) over containerd's own API;
* ``nodecheck``: ``snapshotter check``, whether the node can pull lazily and what to fix,
  reading containerd's configuration per version with ``ctrdconfig``;
* ``keychain``: credentials of pulls (``cri``: the kubelet's, through a CRI image service
  proxy) and of the node (``dockerconfig``: docker configs and Kubernetes secrets);
* ``proto``: the ``.proto`` files and their generated stubs.

May import ``snapshotter.mount`` and everything it may, and imagetool's ``format``,
``errors``, ``stores`` and ``registry``; nothing of the CLI.
"""
