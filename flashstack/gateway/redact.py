"""Credentials out of everything the gateway says: error messages, readiness, logs, the banner.

An upstream's words are data: it may echo the key it was sent ("Incorrect API key provided:
Bearer sk-…"), and an `api_base` may carry credentials itself (`https://user:pass@host`,
`?api-key=…`). A Redactor masks every configured secret, anything shaped like a bearer token or
an API key, and the userinfo and secret-looking query parameters of any URL in a text.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable
from urllib.parse import SplitResult, parse_qsl, quote, unquote, urlsplit

MASK = "***"
# Query parameters whose values are credentials (Azure's api-key, Google's key, SAS sig, ...).
SECRET_PARAMS = frozenset(
    {
        "api-key",
        "api_key",
        "apikey",
        "key",
        "token",
        "access_token",
        "auth",
        "authorization",
        "sig",
        "signature",
        "secret",
        "client_secret",
        "password",
        "pass",
        "pwd",
        "x-api-key",
        "code",
    }
)
# Secrets shorter than this are not searched for: masking "ab" everywhere would garble text and
# tell an attacker more than it hides.
_MIN_SECRET = 4
# An Authorization value: a scheme, then a token with a digit or symbol in it (so the words of
# "Bearer authentication is required" stay).
_TOKEN_SHAPES = re.compile(
    r"(?i)\b(?P<scheme>bearer|basic)\s+(?=[A-Za-z]*[0-9._~+/=:-])(?P<value>[A-Za-z0-9._~+/=:-]{8,})"
    r"|\b(?P<key>sk-[A-Za-z0-9_-]{8,})"  # OpenAI / Anthropic key shape, whoever's it is
)
_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s\"'<>]+")


def redact_url(url: str) -> str:
    """`url` with its userinfo and the values of secret-looking query parameters masked."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return MASK
    netloc = parts.netloc
    if "@" in netloc:
        netloc = MASK + "@" + netloc.rpartition("@")[2]
    query = "&".join(_masked_param(p) for p in parts.query.split("&")) if parts.query else ""
    return SplitResult(parts.scheme, netloc, parts.path, query, parts.fragment).geturl()


def url_secrets(url: str | None) -> list[str]:
    """The credentials inside `url`: userinfo (user and password) and secret query values,
    raw and decoded."""
    if not url:
        return []
    try:
        parts = urlsplit(url)
    except ValueError:
        return []
    found: list[str] = []
    if "@" in parts.netloc:
        userinfo = parts.netloc.rpartition("@")[0]
        found += [
            userinfo,
            *userinfo.split(":", 1),
            base64.b64encode(unquote(userinfo).encode()).decode(),
        ]
    found += [
        v for k, v in parse_qsl(parts.query, keep_blank_values=True) if k.lower() in SECRET_PARAMS
    ]
    raw = list(found)
    found += [unquote(s) for s in raw] + [quote(s, safe="") for s in raw]
    return found


def split_userinfo(url: str) -> tuple[str, str | None, str | None]:
    """(url without userinfo, user, password): the credentials travel as a header instead."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, None, None
    userinfo, _, host = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    bare = SplitResult(parts.scheme, host, parts.path, parts.query, parts.fragment).geturl()
    return bare, unquote(user), unquote(password)


def excerpt(text: str, limit: int) -> str:
    """At most `limit` characters of `text`, marked when cut."""
    return text if len(text) <= limit else text[:limit] + f"… ({len(text) - limit} more characters)"


class Redactor:
    """Masks a fixed set of secrets, token-shaped strings and URL credentials in any text."""

    def __init__(self, secrets: Iterable[str | None] = ()) -> None:
        found = {s for s in secrets if s and len(s) >= _MIN_SECRET}
        # Longest first, so a secret that contains another is masked whole.
        alternatives = "|".join(re.escape(s) for s in sorted(found, key=len, reverse=True))
        self._secrets = re.compile(alternatives) if alternatives else None

    def __call__(self, text: str) -> str:
        """`text` with every secret masked."""
        if self._secrets is not None:
            text = self._secrets.sub(MASK, text)
        if "://" in text:
            text = _URL.sub(lambda m: redact_url(m.group(0)), text)
        return _TOKEN_SHAPES.sub(_mask_token, text)


def secrets_of(models: Iterable[object], *extra: str | None) -> list[str]:
    """What a set of ModelConfigs must never show a client, plus `extra`: each api_key, the
    credentials in each api_base, and each api_base's host (an upstream may quote its
    own address)."""
    found: list[str] = [s for s in extra if s]
    for m in models:
        base = getattr(m, "api_base", None)
        found += [getattr(m, "api_key", None) or "", *url_secrets(base), _host(base)]
    return [s for s in found if s]


def _host(url: str | None) -> str:
    try:
        return urlsplit(url).netloc.rpartition("@")[2] if url else ""
    except ValueError:
        return ""


def _masked_param(pair: str) -> str:
    name, eq, value = pair.partition("=")
    return f"{name}={MASK}" if eq and unquote(name).lower() in SECRET_PARAMS and value else pair


def _mask_token(m: re.Match[str]) -> str:
    if m.group("key"):
        return "sk-" + MASK
    return f"{m.group('scheme')} {MASK}"
