"""Credentials never belong in a spec: the spec is copied into the job's files, its script, its
checkpoints and TensorBoard's hparams, where anyone who can read those can read it.

:func:`secret_problems` refuses, at validation, credential-looking keys of every
``storage_options`` mapping (``data``'s and each ``data.mix`` source's; AWS, Azure and GCS keys
alike), ``slurm.setup`` lines and ``slurm.extra_flags`` that assign a credential a literal value,
and values that look like a credential wherever they are (an AWS key id, a PEM private key, an
Azure SAS signature, a password in a URL). Each problem names the
environment variable or credential file to use instead. :func:`redacted` is the second line: the
copies of a spec that leave it go through it, so a credential-looking key's text is replaced by
:data:`REDACTED` anywhere in the tree.
"""

from __future__ import annotations

import re
from typing import Any, Iterator, Mapping

from lance_hpc.spec.problems import Problem, section_of

REDACTED = "<redacted>"
# Words that make a key a credential wherever they appear in it ...
SECRET_WORDS = frozenset({"secret", "password", "passwd", "passphrase", "token", "credential", "credentials", "sas"})
# ... and the words that make a following "key" one: access_key, account_key, api_key, sse_customer_key.
KEY_QUALIFIERS = frozenset({"access", "account", "master", "private", "api", "customer", "encryption", "signing", "auth"})
# A key that names where a credential is, not the credential: azure_federated_token_file,
# aws_container_credentials_relative_uri, azure_fabric_token_service_url.
LOCATION_WORDS = frozenset({"file", "path", "dir", "url", "uri", "endpoint"})
# object_store takes this one as the path of a service-account key file.
LOCATION_KEYS = frozenset({"google_application_credentials"})
# The AWS options lance_hpc and object_store take without the aws_ prefix.
AWS_SHORT_KEYS = {
    "access_key_id": "AWS_ACCESS_KEY_ID",
    "secret_access_key": "AWS_SECRET_ACCESS_KEY",
    "session_token": "AWS_SESSION_TOKEN",
    "token": "AWS_SESSION_TOKEN",
}
AZURE_SHORT_KEYS = {"access_key", "account_key", "master_key", "client_secret", "sas_key", "sas_token", "bearer_token"}

# NAME=value in shell (after export/declare -x, or inside sbatch's --export=A=1,B=2).
ASSIGNMENT = re.compile(
    r"""(?:^|[\s;&|(,])(?:export\s+|declare\s+-x\s+|typeset\s+-x\s+)?([A-Za-z_][A-Za-z0-9_]*)=("[^"]*"|'[^']*'|[^\s;&|,)]*)"""
)
# --name=value or --name value
FLAG = re.compile(r"""(?:^|\s)--([A-Za-z][A-Za-z0-9_-]*)(?:=|\s+)("[^"]*"|'[^']*'|[^\s;&|]+)""")
# Values that are credentials whatever key holds them.
SECRET_VALUES = (
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), "an AWS access key id"),
    (re.compile(r"-----BEGIN (?:[A-Z]+ )*PRIVATE KEY-----"), "a private key"),
    (re.compile(r"[?&]sig=[^&\s]+"), "an Azure SAS token (sig=...)"),
    (re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]+:[^/\s@]+@"), "a password in a URL (scheme://user:password@host)"),
)


def key_words(key: str) -> list[str]:
    """``azureStorageAccountKey`` or ``AZURE_STORAGE_ACCOUNT_KEY`` -> ``[azure, storage, account, key]``."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(key))
    return [word for word in re.split(r"[^a-z0-9]+", spaced.lower()) if word]


def is_credential_key(key: str) -> bool:
    """True for a key (an option, a variable, a flag) whose value would be a credential."""
    words = key_words(key)
    if not words or "_".join(words) in LOCATION_KEYS or words[-1] in LOCATION_WORDS:
        return False
    if any(word in SECRET_WORDS for word in words):
        return True
    return any(word == "key" and index > 0 and words[index - 1] in KEY_QUALIFIERS for index, word in enumerate(words))


def credential_fix(key: str) -> str:
    """Where the credential ``key`` names goes instead: which variable or file, for its store."""
    name = "_".join(key_words(key))
    if name.startswith("aws_") or name in AWS_SHORT_KEYS:
        variable = AWS_SHORT_KEYS.get(name, name.upper())
        return (
            f"export {variable} in the environment that runs lance-hpc (sbatch passes it on to the job), "
            "or keep the keys in the AWS credentials file (~/.aws/credentials, AWS_PROFILE picks the profile)"
        )
    if name.startswith("azure_") or name in AZURE_SHORT_KEYS:
        variable = name.upper() if name.startswith("azure_") else f"AZURE_STORAGE_{name.upper()}"
        return (
            f"export {variable} in the environment that runs lance-hpc (sbatch passes it on to the job), "
            "or sign in without a secret: a managed identity, azure_federated_token_file, or azure_use_azure_cli: 'true'"
        )
    if name.startswith("google_") or name.startswith("service_account"):
        return (
            "save the service-account key as a file only you can read (chmod 600) and point "
            "GOOGLE_APPLICATION_CREDENTIALS (or the storage option google_service_account) at its path"
        )
    return (
        f"export {name.upper()} in the environment that runs lance-hpc (sbatch passes it on to the job), "
        "or keep it in a file only you can read"
    )


def secret_problems(raw: Mapping[str, Any]) -> list[Problem]:
    """Every credential written into the spec ``raw``, each with where it should live instead."""
    problems = []
    slurm = section_of(raw, "slurm")
    for where, options in _storage_options(raw):
        for key in options:
            if is_credential_key(str(key)):
                problems.append(
                    Problem(
                        f"{where}.{key}",
                        "credentials must not be written in the spec (it is copied into the job's files, script and checkpoints)",
                        credential_fix(str(key)),
                    )
                )
    setup = slurm.get("setup")
    if isinstance(setup, list):
        for index, line in enumerate(setup):
            if isinstance(line, str):
                problems += _shell_problems(line, f"slurm.setup[{index}]")
    flags = slurm.get("extra_flags")
    if isinstance(flags, dict):
        for key, value in flags.items():
            if is_credential_key(str(key)):
                problems.append(
                    Problem(
                        f"slurm.extra_flags.{key}",
                        "an sbatch flag must not carry a credential: the script and SLURM's job record show it to others",
                        credential_fix(str(key)),
                    )
                )
            elif isinstance(value, str):
                problems += _shell_problems(value, f"slurm.extra_flags.{key}")
    reported = {problem.path for problem in problems}
    for path, text in _strings(raw):
        if path in reported:
            continue
        for pattern, what in SECRET_VALUES:
            if pattern.search(text):
                problems.append(
                    Problem(
                        path,
                        f"holds what looks like {what}; credentials must not be written in the spec",
                        "keep it in the environment or in a file only you can read, and name that instead",
                    )
                )
                break
    return problems


def redacted(tree: Any, under_credential_key: bool = False) -> Any:
    """A copy of ``tree`` (the plain dicts and lists of a spec) with every text under a
    credential-looking key, and every credential-looking value in text, replaced by REDACTED.
    Numbers stay: ``pad_token_id: 0`` names a token id, not a credential."""
    if isinstance(tree, Mapping):
        return {key: redacted(value, under_credential_key or is_credential_key(str(key))) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [redacted(item, under_credential_key) for item in tree]
    if isinstance(tree, str):
        return REDACTED if under_credential_key and tree else redact_text(tree)
    return tree


def redact_text(text: str) -> str:
    """``text`` with literal credential assignments and flags (``TOKEN=abc``, ``--password abc``)
    and credential-looking values replaced by REDACTED."""
    for _, _, start, end in _literal_credentials(text):
        text = text[:start] + REDACTED + text[end:]
    for pattern, _ in SECRET_VALUES:
        text = pattern.sub(REDACTED, text)
    return text


def _shell_problems(text: str, path: str) -> list[Problem]:
    problems = []
    for name, _, _, _ in _literal_credentials(text):
        is_flag = name.startswith("--")
        variable = "_".join(key_words(name)).upper()
        read_instead = f'--{name[2:]} "${variable}"' if is_flag else f'export {variable}="$(cat ~/.secrets/{variable.lower()})"'
        problems.append(
            Problem(
                path,
                f"{'passes' if is_flag else 'assigns'} {name} a literal credential, which would be written into the job's script",
                f"{credential_fix(name.lstrip('-'))}; or read it where the job runs: {read_instead}",
            )
        )
    return problems


def _literal_credentials(text: str) -> list[tuple[str, str, int, int]]:
    """(name, value, start, end of value) of each credential-looking assignment or --flag in
    ``text`` whose value is written out, not read from a variable, a command or a file. Last first,
    so the spans can be replaced in order."""
    found = []
    for pattern, prefix in ((ASSIGNMENT, ""), (FLAG, "--")):
        for match in pattern.finditer(text):
            name, value = match.group(1), match.group(2)
            if is_credential_key(name) and _is_literal(value):
                found.append((prefix + name, value, match.start(2), match.end(2)))
    return sorted(found, key=lambda item: item[2], reverse=True)


def _is_literal(value: str) -> bool:
    """A value written out; ``$VAR``, ``"$(cat file)"`` and `` `cmd` `` are read when the job runs."""
    if value.startswith("'"):
        return len(value) > 2
    unquoted = value.strip('"')
    return bool(unquoted) and not unquoted.startswith(("$", "`", "-"))


def _storage_options(tree: Any, path: str = "") -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(YAML path, mapping) of every ``storage_options`` mapping in ``tree``: data's, each mix
    source's (``data.mix[1].storage_options``), and any a section gains later."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            where = f"{path}.{key}" if path else str(key)
            if key == "storage_options" and isinstance(value, Mapping):
                yield where, value
            else:
                yield from _storage_options(value, where)
    elif isinstance(tree, list):
        for index, item in enumerate(tree):
            yield from _storage_options(item, f"{path}[{index}]")


def _strings(tree: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(YAML path, text) of every string in ``tree``, keys included."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            where = f"{path}.{key}" if path else str(key)
            if isinstance(key, str):
                yield where, key
            yield from _strings(value, where)
    elif isinstance(tree, list):
        for index, item in enumerate(tree):
            yield from _strings(item, f"{path}[{index}]")
    elif isinstance(tree, str):
        yield path, tree
