"""Options for each obstore backend (S3, Azure Blob, GCS), read without importing obstore.

From a URL, the caller's ``store_options`` and the environment this works out three things
the adapter needs before it builds an obstore store:

* the obstore config and client options (S3's conditional-put mode, plain HTTP allowed when
  the configured endpoint is ``http://``, as for a local emulator);
* where the credentials come from, named without their values (``millpond doctor`` prints it;
  a failure message names it);
* what to tell someone whose credentials are missing;
* for S3, where each part of an access key comes from (the id, the secret, a session token),
  so a refusal can name the part the store rejected and where it was set.

:func:`check_bucket_name` refuses a bucket or container name the backend's naming rules never
allow, before any request (a request for ``my_bucket!`` is answered with a signature error).

Keys are accepted in obstore's forms: prefixed (``aws_access_key_id``,
``azure_storage_account_key``, ``google_service_account``) or bare (``access_key_id``), any
case. obstore itself also reads each backend's standard variables.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from millpond.errors import ConfigError

__all__ = [
    "BACKENDS",
    "BackendOptions",
    "backend_of",
    "bucket_name_problem",
    "check_bucket_name",
    "prepare",
    "rejection",
]

BACKENDS = {"s3": "s3", "s3a": "s3", "az": "azure", "gs": "gcs"}
"""URL scheme -> backend."""

_PREFIXES = {"s3": ("aws_",), "azure": ("azure_storage_", "azure_"), "gcs": ("google_",)}
_CLIENT_KEYS = frozenset(
    {"connect_timeout", "timeout", "pool_idle_timeout", "pool_max_idle_per_host", "allow_http"}
)
_TRUE = frozenset({"1", "true", "yes", "on"})

# Standard AWS variables and the obstore S3 keys they feed (obstore does not read
# AWS_ENDPOINT_URL or AWS_ALLOW_HTTP the way the AWS CLI does, so they are mapped here).
AWS_ENV = {
    "AWS_ENDPOINT_URL": "aws_endpoint",
    "AWS_ENDPOINT_URL_S3": "aws_endpoint",
    "AWS_ACCESS_KEY_ID": "aws_access_key_id",
    "AWS_SECRET_ACCESS_KEY": "aws_secret_access_key",
    "AWS_SESSION_TOKEN": "aws_session_token",
    "AWS_REGION": "aws_region",
    "AWS_DEFAULT_REGION": "aws_region",
    "AWS_ALLOW_HTTP": "aws_allow_http",
}

# Per backend: (bare option key, the variables obstore reads for it, how it is described).
_CREDENTIALS: dict[str, list[tuple[str, tuple[str, ...], str]]] = {
    "s3": [
        ("skip_signature", ("AWS_SKIP_SIGNATURE",), "none (unsigned requests)"),
        ("access_key_id", ("AWS_ACCESS_KEY_ID",), "an access key"),
        ("web_identity_token_file", ("AWS_WEB_IDENTITY_TOKEN_FILE",), "a web identity token"),
        (
            "container_credentials_relative_uri",
            ("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"),
            "the container credentials endpoint",
        ),
    ],
    "azure": [
        ("skip_signature", ("AZURE_SKIP_SIGNATURE",), "none (unsigned requests)"),
        ("use_emulator", ("AZURE_STORAGE_USE_EMULATOR",), "the emulator's well-known key"),
        (
            "account_key",
            ("AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_ACCESS_KEY", "AZURE_STORAGE_MASTER_KEY"),
            "an account key",
        ),
        ("sas_key", ("AZURE_STORAGE_SAS_KEY", "AZURE_STORAGE_SAS_TOKEN"), "a SAS token"),
        ("token", ("AZURE_STORAGE_TOKEN",), "a bearer token"),
        (
            "client_secret",
            ("AZURE_STORAGE_CLIENT_SECRET", "AZURE_CLIENT_SECRET"),
            "a client secret",
        ),
        ("federated_token_file", ("AZURE_FEDERATED_TOKEN_FILE",), "a federated token"),
        ("use_azure_cli", ("AZURE_USE_AZURE_CLI",), "the Azure CLI"),
    ],
    "gcs": [
        ("skip_signature", ("GOOGLE_SKIP_SIGNATURE",), "none (unsigned requests)"),
        ("service_account_key", ("GOOGLE_SERVICE_ACCOUNT_KEY",), "a service-account key"),
        (
            "service_account",
            ("GOOGLE_SERVICE_ACCOUNT", "GOOGLE_SERVICE_ACCOUNT_PATH"),
            "a service-account file",
        ),
        (
            "application_credentials",
            ("GOOGLE_APPLICATION_CREDENTIALS",),
            "application default credentials",
        ),
        ("bearer_token", ("GOOGLE_BEARER_TOKEN",), "a bearer token"),
    ],
}
_FALLBACK = {
    "s3": "the instance metadata service (nothing else configured)",
    "azure": "managed identity via the instance metadata service (nothing else configured)",
    "gcs": "the instance metadata server (nothing else configured)",
}
_HINTS = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or store_options "
    "aws_access_key_id / aws_secret_access_key), or run where an instance role applies",
    "azure": "set AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY (or a SAS token, "
    "or a client secret), or AZURE_STORAGE_USE_EMULATOR=true for Azurite",
    "gcs": "set GOOGLE_SERVICE_ACCOUNT (a key file) or GOOGLE_SERVICE_ACCOUNT_KEY, or "
    "GOOGLE_APPLICATION_CREDENTIALS",
}


# The parts of an S3 access key: (what it is, its bare option key, the variable obstore reads).
_S3_KEY_PARTS = (
    ("access key id", "access_key_id", "AWS_ACCESS_KEY_ID"),
    ("secret key", "secret_access_key", "AWS_SECRET_ACCESS_KEY"),
    ("session token", "session_token", "AWS_SESSION_TOKEN"),
)
# Bucket and container names: (the noun, the characters no name of this backend can hold, the
# characters a new name may hold, and that rule in words). S3 served buckets named with
# capitals and '_' before 2018 (us-east-1), so only what no S3 bucket ever held is refused.
_NAME_RULES = {
    "s3": (
        "bucket",
        re.compile(r"[^A-Za-z0-9._-]"),
        re.compile(r"[^a-z0-9.-]"),
        "S3 bucket names hold only lowercase letters, digits, '.' and '-'",
    ),
    "gcs": (
        "bucket",
        re.compile(r"[^a-z0-9._-]"),
        re.compile(r"[^a-z0-9._-]"),
        "GCS bucket names hold only lowercase letters, digits, '.', '-' and '_'",
    ),
    "azure": (
        "container",
        re.compile(r"[^a-z0-9-]"),
        re.compile(r"[^a-z0-9-]"),
        "Azure container names hold only lowercase letters, digits and '-'",
    ),
}
# Azure's special containers ($root, $web, $logs) start with a '$'.
_AZURE_SPECIAL = frozenset({"$root", "$web", "$logs"})


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendOptions:
    """What the adapter passes to obstore, and what it says about credentials."""

    backend: str
    """``s3``, ``azure`` or ``gcs``."""
    config: dict[str, Any] = field(repr=False)
    """obstore config keys (may hold secrets: never logged)."""
    client: dict[str, Any]
    """obstore client options."""
    credential_source: str
    """Where the credentials come from, named without their values."""
    credential_hint: str
    """How to provide credentials."""
    credential_parts: dict[str, str] = field(default_factory=dict)
    """S3: where each part of the access key comes from, by part (``access key id``,
    ``secret key``, ``session token``): ``AWS_SECRET_ACCESS_KEY from the environment`` or
    ``store option aws_secret_access_key``. Names only, never values."""


def backend_of(url: str) -> str | None:
    """The backend of a store URL (``s3``, ``azure``, ``gcs``), or ``None``."""
    scheme, sep, _ = url.partition("://")
    return BACKENDS.get(scheme.lower()) if sep else None


def prepare(
    backend: str, options: Mapping[str, str] | None, environ: Mapping[str, str] | None = None
) -> BackendOptions:
    """Split and complete the options for one backend.

    Args:
        backend: ``s3``, ``azure`` or ``gcs``.
        options: the caller's ``store_options``.
        environ: the environment (default ``os.environ``).
    """
    env = os.environ if environ is None else environ
    given = dict(options or {})
    client: dict[str, Any] = {k: v for k, v in given.items() if k in _CLIENT_KEYS}
    config: dict[str, Any] = {k: v for k, v in given.items() if k not in _CLIENT_KEYS}
    from_env: dict[str, str] = {}
    if backend == "s3":
        for variable, key in AWS_ENV.items():
            value = env.get(variable)
            if (
                value
                and key not in config
                and _bare(backend, key) not in _bare_keys(backend, config)
            ):
                config[key] = from_env[key] = value
        # Conditional updates on S3 are ETag based; without this obstore refuses them.
        config.setdefault("aws_conditional_put", "etag")
        # obstore 0.12 parses ``aws_allow_http`` as an S3 key but then panics: it is a client
        # option.
        allow_http = _pop_bare(backend, config, "allow_http")
        if allow_http is not None:
            client.setdefault("allow_http", str(allow_http).strip().lower() in _TRUE)
    bare = _bare_keys(backend, config)
    _check_endpoints(backend, config, from_env, env)
    if _plain_http(backend, bare, env):
        client.setdefault("allow_http", True)
    return BackendOptions(
        backend=backend,
        config=config,
        client=client,
        credential_source=_credential_source(backend, bare, from_env, env),
        credential_hint=_HINTS[backend],
        credential_parts=_s3_key_parts(config, from_env) if backend == "s3" else {},
    )


def _check_endpoints(
    backend: str, config: Mapping[str, Any], from_env: Mapping[str, str], env: Mapping[str, str]
) -> None:
    """Refuse an S3 endpoint or a GCS base URL that is not an absolute http(s) URL.

    obstore takes ``127.0.0.1:9000`` (the scheme left out, as is easy to do for MinIO) and
    panics on the first request: a trace instead of an error, in whichever thread made it.
    (Azure's builder refuses such a URL itself.)

    Raises:
        ConfigError: naming the option or variable the value came from.
    """
    if backend == "s3":
        variables = {key: name for name, key in AWS_ENV.items() if env.get(name)}
        for key, value in config.items():
            if _bare(backend, key) in ("endpoint", "endpoint_url"):
                source = variables.get(key, key) if key in from_env else key
                _check_endpoint(source, value)
    elif backend == "gcs":
        given = _bare_keys(backend, config).get("base_url")
        if given is not None:
            _check_endpoint("google_base_url", given)
        elif env.get("GOOGLE_BASE_URL"):
            _check_endpoint("GOOGLE_BASE_URL", env["GOOGLE_BASE_URL"])


def _check_endpoint(source: str, value: Any) -> None:
    text = str(value)
    try:
        parts = urlsplit(text)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        ok = ok and (parts.port is None or parts.port > 0) and text == text.strip()
    except ValueError:  # a bad port or IPv6 literal
        ok = False
    if not ok:
        raise ConfigError(
            source,
            f"expected an http:// or https:// URL such as http://127.0.0.1:9000, found {text!r}",
        )


def _bare(backend: str, key: str) -> str:
    key = key.lower()
    for prefix in _PREFIXES[backend]:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def _bare_keys(backend: str, config: Mapping[str, Any]) -> dict[str, Any]:
    return {_bare(backend, key): value for key, value in config.items()}


def _pop_bare(backend: str, config: dict[str, Any], bare: str) -> Any:
    for key in list(config):
        if _bare(backend, key) == bare:
            return config.pop(key)
    return None


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in _TRUE


def _plain_http(backend: str, bare: Mapping[str, Any], env: Mapping[str, str]) -> bool:
    """Whether the configured endpoint is plain HTTP (a local server, such as an emulator)."""
    if backend == "s3":
        endpoint = str(bare.get("endpoint") or bare.get("endpoint_url") or "")
        return endpoint.startswith("http://")
    if backend == "azure":
        endpoint = str(
            bare.get("endpoint")
            or env.get("AZURE_STORAGE_ENDPOINT")
            or env.get("AZURE_ENDPOINT")
            or ""
        )
        emulator = bare.get("use_emulator", env.get("AZURE_STORAGE_USE_EMULATOR", ""))
        return endpoint.startswith("http://") or _truthy(emulator)
    base = str(bare.get("base_url") or env.get("GOOGLE_BASE_URL") or "")
    return base.startswith("http://") or _gcs_key_base_url(bare, env).startswith("http://")


def _gcs_key_base_url(bare: Mapping[str, Any], env: Mapping[str, str]) -> str:
    """The ``gcs_base_url`` a service-account key names (emulators put theirs there)."""
    text = bare.get("service_account_key") or env.get("GOOGLE_SERVICE_ACCOUNT_KEY")
    path = (
        bare.get("service_account")
        or bare.get("service_account_path")
        or env.get("GOOGLE_SERVICE_ACCOUNT")
        or env.get("GOOGLE_SERVICE_ACCOUNT_PATH")
    )
    try:
        if not text and path:
            text = Path(str(path)).read_text()
        key = json.loads(text) if text else {}
    except (OSError, ValueError):
        return ""  # obstore reports an unreadable key itself, naming it
    return str(key.get("gcs_base_url") or "") if isinstance(key, dict) else ""


def _credential_source(
    backend: str, bare: Mapping[str, Any], from_env: Mapping[str, str], env: Mapping[str, str]
) -> str:
    for key, variables, what in _CREDENTIALS[backend]:
        if key in bare and (key != "skip_signature" or _truthy(bare[key])):
            if backend == "s3" and key == "access_key_id":
                return _s3_key_source(what, bare, from_env)
            return f"{what} from store_options ({key})"
        for variable in variables:
            value = env.get(variable)
            if value and (key not in ("skip_signature", "use_emulator") or _truthy(value)):
                return f"{what} from the environment ({variable})"
    if backend == "gcs":
        adc = Path.home() / ".config" / "gcloud" / "application_default_credentials.json"
        if adc.is_file():
            return f"application default credentials from {adc}"
    return _FALLBACK[backend]


def _s3_key_source(what: str, bare: Mapping[str, Any], from_env: Mapping[str, str]) -> str:
    """An access key's source; both of its parts when they come from different places (the
    id from ``AWS_ACCESS_KEY_ID``, the secret from an option, as a Spark job may give it)."""
    id_from_env = any(_bare("s3", k) == "access_key_id" for k in from_env)
    secret_from_env = any(_bare("s3", k) == "secret_access_key" for k in from_env)
    source = (
        f"{what} from the environment (AWS_ACCESS_KEY_ID)"
        if id_from_env
        else f"{what} from store_options (access_key_id)"
    )
    if "secret_access_key" in bare and secret_from_env != id_from_env:
        secret = (
            "the environment (AWS_SECRET_ACCESS_KEY)"
            if secret_from_env
            else "store_options (secret_access_key)"
        )
        source += f" with its secret from {secret}"
    return source


def _s3_key_parts(config: Mapping[str, Any], from_env: Mapping[str, str]) -> dict[str, str]:
    parts: dict[str, str] = {}
    for part, bare_key, variable in _S3_KEY_PARTS:
        for key in config:
            if _bare("s3", key) == bare_key:
                parts[part] = (
                    f"{variable} from the environment" if key in from_env else f"store option {key}"
                )
    return parts


def _setting(source: str) -> str:
    """``AWS_X from the environment`` -> ``AWS_X``; ``store option k`` -> ``the store option k``."""
    if source.endswith(" from the environment"):
        return source.removesuffix(" from the environment")
    return f"the {source}"


def rejection(code: str, parts: Mapping[str, str]) -> tuple[str, str] | None:
    """What an S3 store's refusal of an access key means, and its fix, naming where each part
    came from; ``None`` when the code (or what is known of the key) says nothing more precise.

    Args:
        code: the store's error code (``SignatureDoesNotMatch``, ``InvalidAccessKeyId``, ...).
        parts: :attr:`BackendOptions.credential_parts`.

    Returns:
        ``(what is wrong, how to fix it)``.
    """
    key_id, secret, token = (parts.get(p) for p, _, _ in _S3_KEY_PARTS)
    if code == "SignatureDoesNotMatch" and key_id and secret:
        return (
            f"the store rejected the secret key ({secret}): the request's signature does not "
            f"match, so it is not the secret of the access key id ({key_id})",
            f"set {_setting(secret)} to the secret of the access key id in {_setting(key_id)}",
        )
    if code == "InvalidAccessKeyId" and key_id:
        pair = f" (and {_setting(secret)} to its secret)" if secret else ""
        return (
            f"the store does not know the access key id ({key_id})",
            f"set {_setting(key_id)} to an access key id of this store{pair}",
        )
    if code in ("ExpiredToken", "InvalidToken", "TokenRefreshRequired") and token:
        return (
            f"the store rejected the session token ({token}): expired or not valid",
            f"get fresh temporary credentials and set {_setting(token)} (and the key) to them",
        )
    return None


def bucket_name_problem(url: str, *, strict: bool) -> str | None:
    """What is wrong with the bucket or container a store URL names, or ``None``.

    Args:
        url: ``s3://``, ``gs://`` or ``az://`` URL (any other: ``None``).
        strict: judge by the rules for a new bucket (S3: no capitals, no ``_``), not only by
            what no bucket of the backend can hold.
    """
    backend = backend_of(url)
    if backend is None:
        return None
    name = urlsplit(url).netloc
    noun, never, new_name, rule = _NAME_RULES[backend]
    if not name:
        return f"no {noun} named: expected {url.partition('://')[0]}://{noun}[/root]"
    if backend == "azure" and name in _AZURE_SPECIAL:
        return None
    if not (new_name if strict else never).search(name):
        return None
    bad = list(dict.fromkeys(new_name.findall(name)))
    listed = " and ".join(", ".join(repr(c) for c in bad).rsplit(", ", 1))
    return f"{noun} name {name!r} holds {listed}: {rule}"


def check_bucket_name(url: str) -> None:
    """Refuse a store URL whose bucket or container name no store of its backend could have.

    Raises:
        ConfigError: naming the bucket, the characters and the rule.
    """
    problem = bucket_name_problem(url, strict=False)
    if problem is not None:
        raise ConfigError("store", f"{url}: {problem}; fix the store URL")
