"""The ``torch.save`` zip layout, its byte-exact pickle writer and the zip CRC store."""
