"""What tabby says never carries a secret: the one rule of what looks secret, and the
redaction every error, log line and report applies before a value leaves the process.

A secret is a private key in PEM form, the value of a field or word that names a password,
passphrase, secret, token, bearer credential, API key or private key (``key``, ``key_file``
as a field's name: the etcd client key's path is named, never its content), and the
credentials a URL can carry (``user:password@``, a query string). Standard library only:
the CNI binaries' error path loads it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from urllib.parse import urlsplit, urlunsplit

REDACTED = "[REDACTED]"
_PEM_KEY = re.compile(
    r"-----BEGIN ([A-Z0-9 ]*)PRIVATE KEY-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)",
    re.DOTALL,
)
#: the words whose values are redacted
_SECRET_WORDS = "|".join(
    [
        *("password", "passwd", "passphrase", "secret", "token"),
        *("bearer", "authorization", "api[_-]?key", "private[_-]?key"),
    ]
)
#: a secret word (possibly inside a longer name), a separator, a value (quoted or a word;
#: "Bearer x" / "Basic x" as one value)
_SECRET_ASSIGN = re.compile(
    rf"(?i)\b([\w.-]*?(?:{_SECRET_WORDS}))(\"?\s*[:=]\s*|\s+)"
    r"((?:(?:Bearer|Basic)\s+)?(?:\"[^\"]*\"|'[^']*'|[^\s,;}]+))"
)
_SECRET_FIELD = re.compile(rf"(?i)({_SECRET_WORDS}|(^|[_.-])key([_.-]|$)|key_?file$)")
#: a URL with credentials in it: userinfo, or a query string
_URL = re.compile(r"(?i)\b[a-z][a-z0-9+.-]*://[^\s'\"<>]+")


def secret_field(name: str) -> bool:
    """Whether a field named ``name`` holds (or names) a secret: its value is never shown."""
    return bool(_SECRET_FIELD.search(name))


def _url(m: re.Match[str]) -> str:
    text = m.group(0)
    try:
        parts = urlsplit(text)
        host = parts.hostname
        port = parts.port
    except ValueError:
        return text
    if not (parts.username or parts.password or parts.query):
        return text
    netloc = f"{REDACTED}@" if parts.username or parts.password else ""
    netloc += f"[{host}]" if host and ":" in host else (host or "")
    netloc += f":{port}" if port is not None else ""
    query = REDACTED if parts.query else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_text(text: str) -> tuple[str, int]:
    """``text`` with private keys, secret-looking values and URLs' credentials replaced;
    and how many."""
    count = 0

    def pem(m: re.Match[str]) -> str:
        nonlocal count
        count += 1
        return f"[REDACTED {m.group(1)}PRIVATE KEY]"

    def assign(m: re.Match[str]) -> str:
        nonlocal count
        if m.group(3) == REDACTED or m.group(3).strip("\"'") == REDACTED:
            return m.group(0)
        count += 1
        return f"{m.group(1)}{m.group(2)}{REDACTED}"

    def url(m: re.Match[str]) -> str:
        nonlocal count
        clean = _url(m)
        count += clean != m.group(0)
        return clean

    text = _PEM_KEY.sub(pem, text)
    text = _URL.sub(url, text)
    text = _SECRET_ASSIGN.sub(assign, text)
    return text, count


def redact(text: str) -> str:
    """:func:`redact_text` without the count."""
    return redact_text(text)[0]


def shown_value(path: str, value: object, limit: int = 200) -> str:
    """How an error or a log line shows the value of field ``path`` (``ipam.etcd_key_file``,
    ``ipam.etcd_endpoints[0]``): its repr, credentials redacted, cut at ``limit``
    characters; a secret field's value not at all."""
    names = [part for part in re.split(r"[.\[\]]", path) if part and not part.isdigit()]
    if names and secret_field(names[-1]):
        return REDACTED
    shown = redact(repr(value))
    return shown if len(shown) <= limit else shown[:limit] + "..."


def redact_json(value: object) -> tuple[object, int]:
    """A JSON value with secret-looking fields' values replaced (and every string passed
    through :func:`redact_text`); and how many."""
    if isinstance(value, Mapping):
        out: dict[object, object] = {}
        total = 0
        for k, v in value.items():
            if isinstance(k, str) and secret_field(k) and v not in (None, "", [], {}):
                out[k] = REDACTED
                total += 1
            else:
                out[k], n = redact_json(v)
                total += n
        return out, total
    if isinstance(value, list):
        items = [redact_json(v) for v in value]
        return [v for v, _ in items], sum(n for _, n in items)
    if isinstance(value, str):
        return redact_text(value)
    return value, 0
