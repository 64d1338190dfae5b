"""``--help`` of the commands that take a checkpoint describes every form CKPT takes, not only a .mdl file or a
model_dir."""
from __future__ import annotations

import pytest

from helpers import run_ckptfs

pytestmark = pytest.mark.slow  # every test runs the CLI

FORMS = [".mdl", "legacy torch.save", "model_dir", "Hugging Face model folder", "ORG/NAME", "s3://", "S3 layout",
         "run", "TensorFlow checkpoint"]


@pytest.mark.parametrize("command", ["mount", "export", "explain"])
def test_ckpt_help_names_every_form(command):
    r = run_ckptfs(command, "--help", text=True, check=True)
    text = " ".join(r.stdout.split())  # argparse wraps lines
    missing = [f for f in FORMS if f not in text]
    assert not missing, text
