"""The tensor kernel: virtual tensors (``base``), the block cache and read-ahead, tensor operations and element arithmetic, byte-region tensors."""
