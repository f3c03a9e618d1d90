"""The gateway's server TLS: one listening context, its certificate swapped for new handshakes.

Hot rotation. uvicorn hands asyncio one `ssl.SSLContext` at start-up and wraps every accepted
socket with it. That listening context carries an SNI callback, which OpenSSL calls during every
ClientHello (with or without SNI); the callback moves the new connection onto the context built for
the newest certificate (`SSLObject.context = ...`, OpenSSL's SSL_set_SSL_CTX). Connections already
established keep the certificate they shook hands with, so streams in flight finish untouched, and
the swap is one reference assignment, safe from the renewal thread.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from flashstack.gateway.config import TLSConfig
from flashstack.gateway.tls.certs import CertBundle, server_context
from flashstack.gateway.tls.connection import tls_http_protocol
from flashstack.gateway.tls.sources import CertSource, FileCertSource, VaultCertSource

log = logging.getLogger("flashstack.tls")


@dataclass(frozen=True)
class _Active:
    context: ssl.SSLContext
    bundle: CertBundle


class ServerTLS:
    """The gateway's server TLS: one listening context, its certificate swapped for new
    handshakes."""

    def __init__(self, cfg: TLSConfig, source: CertSource) -> None:
        self.cfg, self.source = cfg, source
        bundle = source.initial()
        self._active = _Active(server_context(cfg, bundle), bundle)
        self.context = server_context(cfg, bundle)  # what uvicorn listens with
        self.context.sni_callback = self._select_context
        self.rotations = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, cfg: TLSConfig) -> ServerTLS | None:
        """ServerTLS for `cfg`, or None when TLS is off (no cert_file and no vault)."""
        if cfg.vault is not None:
            return cls(cfg, VaultCertSource(cfg.vault))
        if cfg.cert_file is not None and cfg.key_file is not None:
            ca = (cfg.client_ca_file,) if cfg.client_ca_file else ()
            return cls(
                cfg,
                FileCertSource(cfg.cert_file, cfg.key_file, cfg.watch_interval, cfg.renew_at, ca),
            )
        return None

    @property
    def bundle(self) -> CertBundle:
        """The certificate new handshakes get."""
        return self._active.bundle

    def install(self, bundle: CertBundle) -> None:
        """Serve `bundle` to every handshake from now on; open connections keep theirs."""
        active = _Active(server_context(self.cfg, bundle), bundle)  # raises before anything changes
        previous, self._active = self._active.bundle, active
        self.rotations += 1
        if previous.serial == bundle.serial:
            log.info(
                "server TLS reloaded (client CA changed; certificate serial %s unchanged)",
                bundle.serial_hex,
            )
            return
        log.info(
            "server certificate rotated: serial %s → %s (%s), valid until %s",
            previous.serial_hex,
            bundle.serial_hex,
            bundle.subject,
            datetime.fromtimestamp(bundle.not_after, UTC).isoformat(),
        )

    def _select_context(
        self, ssl_object: Any, server_name: str | None, _listening: ssl.SSLContext
    ) -> None:
        # this handshake only; must not raise (alerts the client)
        ssl_object.context = self._active.context

    def start(self) -> ServerTLS:
        """Watch / renew the certificate in a daemon thread (hvac and file I/O stay off the event
        loop)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="flashstack-tls-renewal", daemon=True
            )
            self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self.source.run(self, self._stop)
        except Exception:  # the thread must not die silently: readiness would never learn
            log.exception(
                "the TLS certificate renewal thread crashed; the current certificate keeps serving"
            )
            self.source.error = "the renewal thread crashed; see the log"

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def status(self) -> dict[str, Any]:
        """For readiness: "ok", "warning" (renewal overdue or failing) or "expired" (not ready)."""
        bundle, now, error = self.bundle, time.time(), self.source.error
        if now >= bundle.not_after:
            state = "expired"
        elif error or now >= bundle.renew_time(self.source.renew_at) + 1.0:
            state = "warning"
        else:
            state = "ok"
        report: dict[str, Any] = {
            "status": state,
            "source": self.source.kind,
            "serial": bundle.serial_hex,
            "subject": bundle.subject,
            "not_after": datetime.fromtimestamp(bundle.not_after, UTC).isoformat(
                timespec="seconds"
            ),
            "seconds_left": round(bundle.not_after - now, 1),
            "rotations": self.rotations,
        }
        if error:
            report["error"] = error
        if state == "warning" and not error:
            report["error"] = (
                f"the certificate is past {self.source.renew_at:.0%} of its lifetime and was "
                "not renewed"
            )
        return report

    def uvicorn_options(self, http: str | type = "httptools") -> dict[str, Any]:
        """Keyword arguments for `uvicorn.Config` / `uvicorn.run` that serve with this TLS."""
        return {
            "ssl_context_factory": lambda _config, _default: self.context,
            "http": tls_http_protocol(http, self.cfg.client_names),
        }
