"""What lazyblock's four tools (imagetool, snapshotter, serving, runtime) share.

* ``cli``: the command-line edge: one form of error message and one set of exit codes.

It imports none of the tools, so every one of them may import it.
"""
