"""Params conversion: finding a checkpoint's params, CS params -> HF config and back, HF defaults."""
