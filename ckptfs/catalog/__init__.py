"""What a checkpoint holds, whatever its backend: the catalog model, torch pytree specs, walking, materialising, metadata checks."""
