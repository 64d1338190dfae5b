"""The Hugging Face reader: a model folder or Hub snapshot (safetensors, ``.bin`` zips) as tensors by region."""
