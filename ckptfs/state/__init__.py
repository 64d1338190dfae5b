"""ckptfs's own files between runs (``dirs``, ``files``) and the files it writes for the user (``outfiles``)."""
