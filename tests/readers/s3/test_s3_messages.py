"""What a user reads when S3 refuses: the IAM permission a refused call needed and what for, credentials that expired
(said so, and never asked again), a profile that is not there (named, with the files looked in), and a successful
``info`` that warns of nothing. Against moto's server on 127.0.0.1 (its IAM emulation for a real denial) and an HTTP
proxy in front of it that answers chosen calls with S3's error XML (``s3faults.py``)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import needs_fuse
from helpers.fuse import is_mounted, mounted_server
from helpers.s3 import FaultProxy, endpoint_with

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # processes: the CLI, a server, TensorFlow

LAYOUT = "s3://ckpts/s3_llama/checkpoint_100.mdl"  # a checkpoint in the S3 layout: a prefix, opened by listing it
SECRET = "ckptfs-test-secret-never-printed"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    yield from endpoint_with(tmp_path_factory.mktemp("s3"), "s3_llama")


@pytest.fixture(scope="module")
def proxy(s3, tmp_path_factory):
    p = FaultProxy(s3.url, tmp_path_factory.mktemp("proxy"))
    yield p
    p.stop()


@pytest.fixture
def env(s3, tmp_path):
    return s3.env(CKPTFS_CACHE_DIR=str(tmp_path / "cache"))


def ckptfs(*args, env):
    r = subprocess.run([sys.executable, "-m", "ckptfs", *map(str, args)], env=env, capture_output=True, text=True,
                       timeout=180)
    return r


def one_line_error(r) -> str:
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert SECRET not in r.stdout + r.stderr
    return lines[0]


def test_a_getobject_only_user_is_told_listing_needs_s3_listbucket(s3, env, tmp_path):
    """A real denial: moto checks an IAM user allowed s3:GetObject only."""
    import boto3

    iam = boto3.client("iam", endpoint_url=s3.url, aws_access_key_id="x", aws_secret_access_key="y",
                       region_name="us-east-1")
    iam.create_user(UserName="reader")
    policy = {"Version": "2012-10-17",
              "Statement": [{"Effect": "Allow", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::ckpts/*"}]}
    iam.put_user_policy(UserName="reader", PolicyName="get-only", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="reader")["AccessKey"]
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    s3.set_auth(True)
    try:
        r = ckptfs("mount", LAYOUT, mnt, env={**env, "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
                                             "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]})
    finally:
        s3.set_auth(False)
    line = one_line_error(r)
    assert "s3:ListBucket on arn:aws:s3:::ckpts was refused (AccessDenied) — listing is needed to" in line, line
    assert "grant it or name the checkpoint object itself" in line and not is_mounted(mnt)
    assert key["SecretAccessKey"] not in r.stderr


@pytest.mark.parametrize("call,permission", [("ListObjectsV2", "s3:ListBucket on arn:aws:s3:::ckpts was refused"),
                                             ("GetObject", "s3:GetObject on arn:aws:s3:::ckpts/s3_llama/"
                                                           "checkpoint_100.mdl/__METADATA__ was refused")])
def test_each_refused_call_names_its_permission(proxy, env, call, permission):
    proxy.set_faults({"call": call, "status": 403, "code": "AccessDenied"})
    try:
        line = one_line_error(ckptfs("info", LAYOUT, env={**env, "AWS_ENDPOINT_URL": proxy.url}))
    finally:
        proxy.set_faults()
    assert permission in line and "(AccessDenied)" in line, line


@pytest.mark.parametrize("code,status", [("ExpiredToken", 400), ("ExpiredTokenException", 400),
                                         ("RequestExpired", 400), ("InvalidToken", 400), ("ExpiredToken", 403)])
def test_expired_credentials_are_said_so_and_never_asked_again(proxy, env, code, status):
    before = proxy.faults()
    proxy.set_faults(*({"call": c, "status": status, "code": code}
                       for c in ("HeadObject", "GetObject", "ListObjectsV2", "HeadBucket")))
    try:
        line = one_line_error(ckptfs("info", LAYOUT, env={**env, "AWS_ENDPOINT_URL": proxy.url,
                                                          "AWS_SESSION_TOKEN": "FQoGZXIvYXdzEXPIRED"}))
    finally:
        proxy.set_faults()
    assert f"({code})" in line and "the endpoint answered" not in line and "attempts" not in line, line
    if code == "InvalidToken":
        assert "the session token is not valid" in line and "AWS_SESSION_TOKEN" in line, line
    else:
        assert "expired" in line and "aws sso login" in line and "AWS_SESSION_TOKEN" in line, line
    after = proxy.faults()
    asked = {c: after.get(c, 0) - before.get(c, 0) for c in after}
    # the HEAD (whose error answer has no body), botocore's look for the bucket's region after a HEAD's 400 or 403,
    # and the GET of one byte that says why: each asked once, none again
    assert asked.get("HeadObject") == 1 and asked.get("GetObject") == 1 and max(asked.values()) == 1, asked
    assert "FQoGZXIvYXdzEXPIRED" not in line


@needs_fuse
def test_credentials_expiring_during_a_mount_give_eio_and_a_log_line_saying_so(s3, proxy, env):
    rel = "tensors/model/ln_f/weight.npy"
    with mounted_server(LAYOUT, "--endpoint-url", proxy.url, env=env) as srv:
        mnt = srv.mnt
        proxy.set_faults({"call": "GetObject", "status": 400, "code": "ExpiredToken"})
        try:
            with pytest.raises(OSError) as err:
                (mnt / rel).read_bytes()
        finally:
            proxy.set_faults()
        assert err.value.errno == 5
        assert (mnt / "README.txt").read_text()  # the other files keep answering
        logs = srv.log()
    assert "the credentials have expired (ExpiredToken)" in logs, logs[-2000:]


def test_a_missing_profile_is_named_with_the_files_looked_in(env, tmp_path):
    config = tmp_path / "aws-config"
    config.write_text("[profile other]\nregion = us-east-1\n")
    r = ckptfs("info", LAYOUT, env={**env, "AWS_PROFILE": "ghost", "AWS_CONFIG_FILE": str(config)})
    line = one_line_error(r)
    assert "AWS profile 'ghost' (from AWS_PROFILE) not found" in line, line
    assert f"{config} (AWS_CONFIG_FILE)" in line and "None" not in line, line
    line = one_line_error(ckptfs("info", LAYOUT, "--profile", "nope", env={**env, "AWS_CONFIG_FILE": str(config)}))
    assert "AWS profile 'nope' (from --profile) not found" in line, line


def test_info_of_a_bucket_checkpoint_says_where_its_params_came_from_without_a_warning(env):
    r = ckptfs("info", LAYOUT, env=env)
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stdout + r.stderr, r.stdout
    assert "\nparams: s3://ckpts/s3_llama/params.yaml (fetched to " in r.stdout, r.stdout
