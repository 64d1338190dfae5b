"""One module per CLI command: add_parser(subparsers) and run(args) -> int; and the ``CKPT`` argument they share,
every form of checkpoint ckptfs opens, said once for every ``--help`` (here: building one command's parser imports no
other module of this package)."""
from __future__ import annotations

#: what ``CKPT`` may be (``mount --help``, ``export --help``, ``explain --help``)
CKPT_HELP = ("the checkpoint: a Cerebras .mdl file (HDF5, any release; or a legacy torch.save file); a model_dir "
             "(mount: the whole run, live; export: its latest checkpoint); a Hugging Face model folder or Hub cache "
             "snapshot; a Hub id ORG/NAME; s3://BUCKET/KEY naming an .mdl object, a checkpoint in the S3 layout "
             "(a prefix holding __METADATA__) or a run (a prefix of checkpoint_<step>.mdl); a TensorFlow checkpoint "
             "(its prefix, e.g. model.ckpt-1000, or its folder)")

#: the same, for a command's description
CKPT_FORMS = ("CKPT is a Cerebras .mdl file (or a legacy torch.save file), a model_dir, a Hugging Face model folder "
              "or Hub id ORG/NAME, an s3:// object, S3-layout prefix or run, or a TensorFlow checkpoint.")
