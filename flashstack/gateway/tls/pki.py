"""Issue certificates from a Vault / OpenBao PKI engine with hvac: token or AppRole auth from env.

hvac is synchronous (requests); callers run `VaultIssuer.issue` in the renewal thread, never on the
event loop. Vault's own TLS certificate is always verified: against `ca_bundle` when given, else
against the system store. Plain http is accepted only on loopback, where there is no wire to sniff.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlsplit

import hvac
import requests

from flashstack.gateway.config import VaultConfig


class VaultError(RuntimeError):
    """Vault / OpenBao could not be reached or refused; the message says what to check."""


@dataclass(frozen=True)
class IssuedCert:
    """What `pki/issue/<role>` returns, as PEM text."""

    cert_pem: str  # leaf first, then the CA chain
    key_pem: str
    issuing_ca_pem: str
    serial: str  # Vault's colon-separated hex form


class VaultIssuer:
    """Logs in to Vault (token or AppRole) and issues leaf certificates from one PKI role."""

    def __init__(self, cfg: VaultConfig) -> None:
        _check_addr(cfg.addr)
        self.cfg = cfg
        verify: str | bool = str(cfg.ca_bundle) if cfg.ca_bundle else True
        if cfg.ca_bundle is not None and not cfg.ca_bundle.is_file():
            raise VaultError(
                f"server.tls.vault.ca_bundle {cfg.ca_bundle} does not exist; point it at the CA "
                "PEM that signs Vault's certificate"
            )
        # token="" keeps hvac from reading $VAULT_TOKEN or ~/.vault-token behind the config's back.
        self.client = hvac.Client(
            url=cfg.addr, token="", verify=verify, timeout=cfg.timeout, namespace=cfg.namespace
        )

    def issue(self) -> IssuedCert:
        """A fresh certificate for the configured common name; raises VaultError on any failure."""
        try:
            response = self._generate()
        except hvac.exceptions.Forbidden as e:
            raise VaultError(
                f"Vault at {self.cfg.addr} refused to issue from {self._path()}: {e}; "
                "check the token's policy"
            ) from e
        except hvac.exceptions.VaultError as e:
            raise VaultError(
                f"Vault at {self.cfg.addr} failed to issue from {self._path()}: "
                f"{type(e).__name__}: {e}"
            ) from e
        except requests.exceptions.SSLError as e:
            raise VaultError(
                f"Vault at {self.cfg.addr} has a TLS certificate we cannot verify ({e}); set "
                "server.tls.vault.ca_bundle to the CA that signs it"
            ) from e
        # OSError: ca_bundle unreadable
        except (requests.exceptions.RequestException, OSError) as e:
            raise VaultError(
                f"cannot reach Vault at {self.cfg.addr}: {type(e).__name__}: {e}"
            ) from e
        try:
            return _issued(response["data"])
        except (KeyError, TypeError, AttributeError) as e:
            raise VaultError(
                f"Vault at {self.cfg.addr} answered {self._path()} without a certificate ({e!r})"
            ) from e

    def _generate(self) -> dict:
        self._login_if_needed()
        try:
            return self._generate_once()
        except hvac.exceptions.Forbidden:
            if self._uses_token_env():
                raise
            self.client.token = ""  # the AppRole token expired: log in again, once, right away
            self._login_if_needed()
            return self._generate_once()

    def _generate_once(self) -> dict:
        return self.client.secrets.pki.generate_certificate(
            name=self.cfg.role,
            common_name=self.cfg.common_name,
            extra_params=self._params(),
            mount_point=self.cfg.pki_mount,
        )

    def _uses_token_env(self) -> bool:
        return bool(os.environ.get(self.cfg.token_env))

    def _params(self) -> dict[str, str]:
        params = {"ttl": self.cfg.ttl, "format": "pem"}
        if self.cfg.alt_names:
            params["alt_names"] = ",".join(self.cfg.alt_names)
        if self.cfg.ip_sans:
            params["ip_sans"] = ",".join(self.cfg.ip_sans)
        return params

    def _path(self) -> str:
        return f"{self.cfg.pki_mount}/issue/{self.cfg.role}"

    def _login_if_needed(self) -> None:
        token = os.environ.get(self.cfg.token_env)
        if token:
            self.client.token = token
            return
        if self.client.token:
            return
        role_id, secret_id = (
            os.environ.get(self.cfg.role_id_env),
            os.environ.get(self.cfg.secret_id_env),
        )
        if not (role_id and secret_id):
            raise VaultError(
                f"no Vault credentials: export ${self.cfg.token_env}, or "
                f"${self.cfg.role_id_env} and ${self.cfg.secret_id_env} for AppRole"
            )
        self.client.auth.approle.login(
            role_id=role_id, secret_id=secret_id, mount_point=self.cfg.approle_mount
        )


def _issued(data: dict) -> IssuedCert:
    chain = [c for c in data.get("ca_chain") or [data["issuing_ca"]] if c.strip()]
    return IssuedCert(
        cert_pem="\n".join([data["certificate"].strip(), *(c.strip() for c in chain)]) + "\n",
        key_pem=data["private_key"].strip() + "\n",
        issuing_ca_pem=data["issuing_ca"].strip() + "\n",
        serial=data["serial_number"],
    )


def _check_addr(addr: str) -> None:
    url = urlsplit(addr)
    if url.scheme == "https":
        return
    if url.scheme == "http" and url.hostname in ("127.0.0.1", "localhost", "::1"):
        return
    raise VaultError(
        f"server.tls.vault.addr {addr!r} must be an https:// URL (plain http only on loopback)"
    )
