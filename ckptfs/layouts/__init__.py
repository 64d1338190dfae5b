"""layouts layer."""
