"""Client identity: the verified certificate a client presented (mTLS), kept in the scope."""

from __future__ import annotations

import fnmatch
import hashlib
from dataclasses import dataclass
from typing import Any

CLIENT_CERT_STATE_KEY = "client_cert"  # request.state.client_cert


@dataclass(frozen=True)
class ClientIdentity:
    """The verified certificate a client presented on this connection (mTLS)."""

    subject: str  # "CN=svc-a,O=Example"
    common_name: str | None
    dns_names: tuple[str, ...]
    uris: tuple[str, ...]
    emails: tuple[str, ...]
    serial: str  # hex
    not_after: str  # as OpenSSL prints it
    fingerprint_sha256: str  # hex, of the DER certificate

    @property
    def names(self) -> tuple[str, ...]:
        """Every name the certificate vouches for: CN first, then SANs."""
        head = (self.common_name,) if self.common_name else ()
        return head + self.dns_names + self.uris + self.emails

    def matches(self, patterns: list[str]) -> bool:
        """Whether any name matches any glob (`svc-*.internal`, `spiffe://prod/*`);
        case-insensitive."""
        return any(fnmatch.fnmatchcase(n.lower(), p.lower()) for n in self.names for p in patterns)


def peer_identity(ssl_object: Any) -> ClientIdentity | None:
    """The verified client certificate of a connection, None when the client sent none."""
    info = ssl_object.getpeercert()
    der = ssl_object.getpeercert(True)
    if not info or not der:
        return None
    rdns = [attr for rdn in info.get("subject", ()) for attr in rdn]
    sans = info.get("subjectAltName", ())
    return ClientIdentity(
        subject=",".join(f"{_RDN_SHORT.get(k, k)}={v}" for k, v in reversed(rdns)),
        common_name=next((v for k, v in rdns if k == "commonName"), None),
        dns_names=tuple(v for k, v in sans if k == "DNS"),
        uris=tuple(v for k, v in sans if k == "URI"),
        emails=tuple(v for k, v in sans if k == "email"),
        serial=format(int(info.get("serialNumber") or "0", 16), "x"),  # OpenSSL pads to whole bytes
        not_after=info.get("notAfter", ""),
        fingerprint_sha256=hashlib.sha256(der).hexdigest(),
    )


def client_identity(request_or_scope: Any) -> ClientIdentity | None:
    """The mTLS client identity of a Starlette request (or ASGI scope), None without one."""
    scope = getattr(request_or_scope, "scope", request_or_scope)
    return (scope.get("state") or {}).get(CLIENT_CERT_STATE_KEY)


_RDN_SHORT = {
    "commonName": "CN",
    "organizationName": "O",
    "organizationalUnitName": "OU",
    "countryName": "C",
    "localityName": "L",
    "stateOrProvinceName": "ST",
    "emailAddress": "emailAddress",
}
