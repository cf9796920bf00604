"""``python -m snapshotter``: the ``snapshotter`` command."""

from snapshotter.cli import main

main()
