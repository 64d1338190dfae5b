"""The Cerebras S3 layout reader: a checkpoint saved by ``cstorch.save("s3://...")`` as a prefix of objects."""
