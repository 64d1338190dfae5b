"""The FUSE frontend: the thin operations adapter (``operations``) and the mount lifecycle (``mount``)."""
