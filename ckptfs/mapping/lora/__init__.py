"""LoRA: finding adapter matrices, folding them lazily, the PEFT adapter output, the YAML section."""
