"""Storage: where a checkpoint's bytes live — the interface (``base``: a ``Blob`` read by byte ranges, a ``Folder`` of
entries) and one module per backend (``local``: files on a local disk; ``s3object``/``s3folder``: objects and
prefixes of an S3 bucket). Nothing here knows about checkpoints."""
