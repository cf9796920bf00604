"""lazyblock serving."""
