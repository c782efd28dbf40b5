"""Storage options for a dataset or checkpoint URI: the spec's options plus credentials from the
environment, and the redaction every message that could echo an option goes through.

Credentials only ever travel inside the options dict handed to Lance (and pickled into DataLoader
workers); they are never printed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlparse

# Environment variable -> Lance (object_store) option, for s3:// URIs.
S3_ENV_OPTIONS = (
    ("AWS_ACCESS_KEY_ID", "access_key_id"),
    ("AWS_SECRET_ACCESS_KEY", "secret_access_key"),
    ("AWS_SESSION_TOKEN", "session_token"),
    ("AWS_REGION", "region"),
    ("AWS_DEFAULT_REGION", "region"),
    ("AWS_ENDPOINT_URL_S3", "endpoint"),
    ("AWS_ENDPOINT_URL", "endpoint"),
)
SECRET_OPTIONS = ("access_key_id", "secret_access_key", "session_token")
# A preflight should answer in seconds, not after object_store's default retries (minutes).
PREFLIGHT_OPTIONS = {"client_max_retries": "1", "client_retry_timeout": "15", "connect_timeout": "5s"}
# object_store (and so Lance) assumes this region when none is configured; so do checkpoints.
DEFAULT_REGION = "us-east-1"
# URI schemes a checkpoint.dir may have besides a plain directory (lance_hpc.checkpoint.stores.STORES)
CHECKPOINT_SCHEMES = ("s3",)
CREDENTIAL_FIX = (
    "export valid AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary "
    "credentials) for this endpoint in the environment that runs lance-hpc and the job"
)


def is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def storage_options(
    uri: str, options: Mapping[str, str] | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Lance storage options for ``uri``: the spec's options, then credentials and region/endpoint
    from AWS-style environment variables for anything the spec does not set."""
    environ = os.environ if environ is None else environ
    result = {str(key): str(value) for key, value in (options or {}).items()}
    if uri.startswith("s3://"):
        for variable, option in S3_ENV_OPTIONS:
            if environ.get(variable) and option not in result:
                result[option] = environ[variable]
        if result.get("endpoint", "").startswith("http://") and "allow_http" not in result:
            result["allow_http"] = "true"
    return result


def redact(text: str, options: Mapping[str, str]) -> str:
    """``text`` with every credential value in ``options`` replaced by ***."""
    for key in SECRET_OPTIONS:
        value = options.get(key)
        if value:
            text = text.replace(value, "***")
    return text


def filesystem_arguments(options: Mapping[str, str]) -> dict[str, Any]:
    """pyarrow S3FileSystem arguments from Lance-style storage options (see storage_options)."""
    arguments: dict[str, Any] = {
        "region": options.get("region", DEFAULT_REGION),
        # small checkpoints go up in one PUT, and a missing bucket fails the write, not the open
        "allow_delayed_open": True,
    }
    if options.get("access_key_id") and options.get("secret_access_key"):
        arguments.update(
            access_key=options["access_key_id"],
            secret_key=options["secret_access_key"],
            session_token=options.get("session_token"),
        )
    endpoint = options.get("endpoint")
    if endpoint:
        parsed = urlparse(endpoint if "://" in endpoint else f"https://{endpoint}")
        arguments.update(scheme=parsed.scheme, endpoint_override=parsed.netloc)
    return arguments


def unsupported(directory: str | Path) -> str | None:
    """Why ``directory`` cannot hold checkpoints (with the fix after a newline), or None."""
    text = str(directory)
    scheme, separator, rest = text.partition("://")
    if not separator:
        return None
    valid = ", ".join(f"{name}://bucket/prefix" for name in CHECKPOINT_SCHEMES)
    if scheme not in CHECKPOINT_SCHEMES:
        return f"{scheme}:// is not a checkpoint store\n  fix: use a local directory or {valid}"
    if not rest.split("/", 1)[0]:
        return f"{text} names no bucket\n  fix: write it as {scheme}://bucket/prefix"
    return None
