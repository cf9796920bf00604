"""lazyblock snapshotter."""
