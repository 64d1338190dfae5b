"""The mapping YAML language: expressions, key patterns, the validated spec, the family registry."""
