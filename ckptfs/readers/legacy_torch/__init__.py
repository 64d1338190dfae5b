"""The legacy-mode reader: a Cerebras state saved with torch.save (a zip), read without unpickling, tensors as byte ranges of its members."""
