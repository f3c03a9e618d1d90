"""The gateway app for servers that import an ASGI app by name (granian), from
$FLASHSTACK_CONFIG."""

from __future__ import annotations

import os
from pathlib import Path

from flashstack.cli import resolve_config
from flashstack.gateway.app import create_app

app = create_app(resolve_config(Path(os.environ["FLASHSTACK_CONFIG"])))
