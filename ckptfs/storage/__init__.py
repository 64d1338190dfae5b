"""Storage: where a checkpoint's bytes live — the interface (``base``: a ``Blob`` read by byte ranges, a ``Folder`` of
entries) and one module per backend (``local``: files on a local disk). Nothing here knows about checkpoints."""
