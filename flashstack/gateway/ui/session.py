"""The console's sign-in: the master key buys a signed cookie; every change also needs a CSRF token.

The cookie is `expiry.nonce.signature`, an HMAC-SHA256 under a key derived from the master key, so
any replica verifies it, and changing the master key signs everyone out. It is HttpOnly and
SameSite=Strict; the CSRF token (an HMAC of the nonce) is handed to the page's own script only and
must come back in `x-csrf-token` on every POST and DELETE, whose Origin, when sent, must be ours.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

COOKIE = "fs_console"
CSRF_HEADER = "x-csrf-token"


@dataclass(frozen=True, slots=True)
class ConsoleSession:
    nonce: str
    expires: int
    csrf: str


class Signer:
    """Issues and checks console cookies for one master key."""

    def __init__(self, master_key: str, ttl: float) -> None:
        self._key = hmac.new(
            master_key.encode(), b"flashstack console session", hashlib.sha256
        ).digest()
        self.ttl = ttl

    def _mac(self, text: str) -> str:
        return hmac.new(self._key, text.encode(), hashlib.sha256).hexdigest()

    def issue(self) -> tuple[str, ConsoleSession]:
        """(cookie value, session) for a fresh sign-in."""
        nonce, expires = secrets.token_urlsafe(18), int(time.time() + self.ttl)
        body = f"{expires}.{nonce}"
        return f"{body}.{self._mac(body)}", self._session(nonce, expires)

    def verify(self, cookie: str | None) -> ConsoleSession | None:
        """The session a cookie stands for, or None if it is missing, forged or expired."""
        if not cookie or cookie.count(".") != 2:
            return None
        expires, nonce, mac = cookie.split(".")
        if not expires.isdigit() or not hmac.compare_digest(mac, self._mac(f"{expires}.{nonce}")):
            return None
        if int(expires) <= time.time():
            return None
        return self._session(nonce, int(expires))

    def _session(self, nonce: str, expires: int) -> ConsoleSession:
        return ConsoleSession(nonce, expires, self._mac("csrf:" + nonce))

    @staticmethod
    def csrf_ok(session: ConsoleSession, token: str | None) -> bool:
        return bool(token) and hmac.compare_digest(session.csrf, token or "")
