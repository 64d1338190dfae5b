"""The Hugging Face view: config, weights in every format, shards, tokenizer overlay, token ids."""
