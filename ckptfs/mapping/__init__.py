"""mapping layer."""
