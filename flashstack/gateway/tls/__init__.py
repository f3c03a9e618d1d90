"""Server and upstream TLS: certificates from files or Vault, rotated without dropping a connection.

certs.py: a certificate bundle and the server context built for it. sources.py: where bundles
come from (files polled for changes, Vault / OpenBao PKI through pki.py). server.py: the listening
context whose certificate is swapped for new handshakes. identity.py and connection.py: a client's
verified certificate, checked against `client_names` and put in each request's scope, so auth can
accept a certificate in place of an API key. upstream.py: client contexts for upstream mTLS.
"""

from flashstack.gateway.tls.certs import CertBundle, TLSError
from flashstack.gateway.tls.identity import CLIENT_CERT_STATE_KEY, ClientIdentity, client_identity
from flashstack.gateway.tls.server import ServerTLS
from flashstack.gateway.tls.upstream import ReloadingClientContext, upstream_ssl_context

__all__ = [
    "CLIENT_CERT_STATE_KEY",
    "CertBundle",
    "ClientIdentity",
    "ReloadingClientContext",
    "ServerTLS",
    "TLSError",
    "client_identity",
    "upstream_ssl_context",
]
