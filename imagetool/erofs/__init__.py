"""EROFS filesystem images: a writer and a pure-Python reader."""
