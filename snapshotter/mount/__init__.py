"""One lazy mount of a block image, and the process that serves it.

* ``api``: ``mount``, ``unmount``, ``stats``, ``list_mounts``, ``profile``: what the CLI
  and the containerd side call;
* ``server``: the mount server, one long-lived process per mounted image (index, metadata,
  FUSE, erofs, prefetch, control socket);
* ``forkserver``: a pre-imported parent that forks mount servers in milliseconds;
  ``launcher``: the same as a node service, so that mount servers live outside the
  daemon's pod;
* ``holder`` (keeps a mount's FUSE connection across its servers, starts a successor when
  one dies) and ``handover`` (a successor taking a live mount over: ``api.replace``);
* ``state`` (mount records on disk), ``control`` (the server's control socket);
* ``fuse``: the image as one read-only FUSE file, reads answered by the data path, on
  ``fusewire`` (the FUSE protocol on ``/dev/fuse``, without libfuse);
* ``kernel``: the kernel's erofs on that file (loop device or file-backed), and unmounting;
* ``localcopy``: a whole image copied out of the cache for its loop device to read past FUSE
  (``mount.local_copy``);
* ``memory``: the server's use of glibc's allocator.

May import ``snapshotter.datapath``, ``snapshotter.cache``, the leaves and imagetool's
``format``, ``errors``, ``stores`` and ``registry``; nothing of containerd or the CLI.
"""
