"""Talking to OCI registries (the distribution spec) and to HTTP object stores.

* ``client``: ``RegistryClient``, one repository on one registry: manifests, blobs, ranged
  reads, uploads, tags; retries and error mapping (httpx).
* ``auth``: credentials (docker ``config.json``, or given at run time), ``WWW-Authenticate``
  challenges and bearer tokens.
* ``ranged``: ranged GETs received straight into the caller's buffers (``http.client``),
  directly or through a proxy: the data path of the registry client and of the S3 store.
* ``hosts``: containerd's registry hosts directory (``hosts.toml``): mirrors and servers.
* ``mirrors``: ``HostChain``, a repository's blobs read from its mirrors first, with
  back-off and failover, and what each host did.

Imports ``imagetool.errors``, ``imagetool.format`` and ``imagetool.stores`` (its options,
bodies and reference names), nothing above them.
"""
