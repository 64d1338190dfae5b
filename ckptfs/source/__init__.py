"""source layer."""
