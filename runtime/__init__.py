"""lazyblock runtime."""
