"""imagetool: convert OCI images into lazyblock block images, and read them back."""

__version__ = "0.1.0"
