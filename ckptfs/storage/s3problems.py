"""What to tell a user whose S3 request was refused: the IAM permission each call ckptfs makes needs, credentials that
expired, a profile that is not there. Pure functions of the call and the answer's error code (no I/O but reading the
``AWS_*`` environment, no secret in any line).

Every S3 call ckptfs makes, and the IAM action a policy must allow for it (``CALLS``):

=================  ================  =================================================================
call               IAM action        what it is for
=================  ================  =================================================================
``HeadObject``     ``s3:GetObject``  an object's size and ETag (opening an ``.mdl`` object, ``latest``)
``GetObject``      ``s3:GetObject``  every byte served (by range), ``__METADATA__``, params, tokenizer
``ListObjectsV2``  ``s3:ListBucket`` a prefix's objects: a checkpoint in the S3 layout, a run, the params
                                     and tokenizer files beside a checkpoint
``HeadBucket``     ``s3:ListBucket`` whether an empty prefix's bucket exists
=================  ================  =================================================================
"""
from __future__ import annotations

from dataclasses import dataclass
from ..env import aws_environment


@dataclass(frozen=True)
class S3Call:
    """One S3 call: the IAM action that allows it, whether that action's resource is the bucket (else the object),
    and why ckptfs makes the call."""

    action: str
    on_bucket: bool
    needed_for: str


CALLS = {
    "HeadObject": S3Call("s3:GetObject", False, "reading an object is needed for every file served"),
    "GetObject": S3Call("s3:GetObject", False, "reading an object is needed for every file served"),
    "ListObjectsV2": S3Call("s3:ListBucket", True,
                            "listing is needed to open a checkpoint stored as a prefix (the S3 layout) or a run, and "
                            "to find the params and tokenizer files beside a checkpoint"),
    "HeadBucket": S3Call("s3:ListBucket", True, "listing is needed to tell an empty prefix from a missing bucket"),
}

#: error codes that say the credentials are no longer valid: refreshing them is the cure, asking again is not
EXPIRED_CODES = frozenset({"ExpiredToken", "ExpiredTokenException", "RequestExpired", "TokenRefreshRequired"})
#: error codes that say the credentials are wrong (a key, a secret or a token that is not valid)
REFUSED_CODES = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "InvalidSecurity",
                           "AuthorizationHeaderMalformed", "InvalidClientTokenId", "UnrecognizedClientException"})
#: every credential error: never retried
CREDENTIAL_CODES = EXPIRED_CODES | REFUSED_CODES
#: what botocore raises when a profile's SSO session is over or was never started
SSO_ERRORS = frozenset({"UnauthorizedSSOTokenError", "SSOTokenLoadError", "SSOError", "TokenRetrievalError",
                        "PendingAuthorizationExpiredError"})


def arn(bucket: str, key: str | None = None) -> str:
    """The ARN a policy names: the bucket's, or one object's."""
    return f"arn:aws:s3:::{bucket}" + (f"/{key}" if key is not None else "")


def denied_problem(operation: str | None, bucket: str, key: str | None, code: str) -> str:
    """The line for an access denied answer to ``operation`` on ``bucket`` (and ``key``): which permission on which
    resource was refused, what it is needed for, what to do."""
    call = CALLS.get(operation or "")
    if call is None:
        return f"access denied ({code}) for these credentials"
    resource = arn(bucket) if call.on_bucket or not key else arn(bucket, key)
    line = f"access denied: {call.action} on {resource} was refused ({code}) — {call.needed_for}"
    if operation == "HeadObject":
        line += " (S3 answers a HEAD of a missing object so too when s3:ListBucket is not granted)"
    return line + ("; grant it or name the checkpoint object itself (s3://BUCKET/…/checkpoint_N.mdl)"
                   if call.action == "s3:ListBucket" else "; grant it")


def profile_name() -> tuple:
    """``(name, what named it)`` of the profile boto3 uses when ``--profile`` names none."""
    env = dict(aws_environment())
    for var in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
        if env.get(var):
            return env[var], var
    return "default", "the default"


def _file(var: str, default: str) -> str:
    value = dict(aws_environment()).get(var)
    return f"{value} ({var})" if value else default


def profile_problem(profile: str | None) -> str:
    """The line for a profile boto3 did not find: its name, what named it, the files looked in."""
    name, source = (profile, "--profile") if profile else profile_name()
    return (f"AWS profile {name!r} (from {source}) not found: looked in "
            f"{_file('AWS_CONFIG_FILE', '~/.aws/config')} and "
            f"{_file('AWS_SHARED_CREDENTIALS_FILE', '~/.aws/credentials')}; add it (aws configure --profile {name}) "
            "or name an existing one with --profile or AWS_PROFILE")


def _login_hint(profile: str | None) -> str:
    name = profile or (profile_name()[0] if profile_name()[1] != "the default" else None)
    return f"aws sso login --profile {name}" if name else "aws sso login"


def credentials_problem(code: str, profile: str | None) -> str:
    """The line for credentials the endpoint refused with ``code``."""
    if code in EXPIRED_CODES:
        why = ("the credentials have expired" if code != "RequestExpired"
               else "the request's signature has expired (the credentials have expired, or this machine's clock is "
                    "off)")
        return (f"{why} ({code}): refresh them — `{_login_hint(profile)}` for an SSO profile, a new session token "
                "(AWS_SESSION_TOKEN with its AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, e.g. from `aws sts "
                "assume-role`) otherwise — and run again")
    if code == "InvalidToken":
        return (f"the session token is not valid ({code}): set AWS_SESSION_TOKEN to the token issued with "
                "AWS_ACCESS_KEY_ID (or unset it for long-term keys), or refresh the profile's credentials")
    return (f"the endpoint refused the credentials ({code}): check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, the "
            "profile, or the token's expiry")


def sso_problem(profile: str | None) -> str:
    """The line for a profile whose SSO session is over or was never started."""
    return f"the AWS SSO session of the profile has expired or was never started: run `{_login_hint(profile)}`"
