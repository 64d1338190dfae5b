"""Training runs: a Model Zoo ``model_dir`` (local or a bucket prefix), its checkpoints and which one is latest."""
