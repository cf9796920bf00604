"""Storage backends for block images, chosen by URL."""
