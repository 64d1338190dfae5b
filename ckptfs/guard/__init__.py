"""Input guards for untrusted checkpoints: a pickle decoder that runs nothing, bounded YAML, confinement of links and references, change detection."""
