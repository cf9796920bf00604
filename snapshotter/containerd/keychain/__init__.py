"""Registry credentials for the mounts the daemon starts.

* ``cri``: the kubelet's pull credentials, read from CRI ``PullImage`` calls by an image
  service proxy, kept in memory per repository;
* ``dockerconfig``: the node's docker configs and mounted Kubernetes secrets, merged into
  one file for the mount servers.
"""
