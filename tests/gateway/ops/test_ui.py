"""The console at /ui: sign-in and CSRF over HTTP, then the pages in a real browser
(Debian's chromium).

Screenshots go to $FLASHSTACK_UI_SCREENSHOTS (docs/ui for the docs), else to the test's tmp dir.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import httpx
import pytest
import uvicorn

from flashstack.gateway.app import create_app
from flashstack.gateway.config import AuthConfig, Config, ModelConfig, RouterConfig
from tests.fakes.server import FakeServer
from tests.gateway.ops import metered_upstream
from tests.gateway.sessions.support import MASTER_KEY, auth_headers, create_key

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[3]


class Upstream:
    """The metered upstream on a port of its own that it keeps across a kill and a restart."""

    def __init__(self) -> None:
        self.app = metered_upstream.create_app(input_tokens=1000, cache_read=200)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> Upstream:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.server = uvicorn.Server(
            uvicorn.Config(
                self.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1
            )
        )
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "upstream did not start"
            time.sleep(0.01)
        return self

    def kill(self) -> None:
        assert self.server is not None and self.thread is not None
        self.server.should_exit = True
        self.thread.join(10)


def _config(upstream: Upstream, tmp: Path, master_key: str | None = MASTER_KEY) -> Config:
    return Config(
        models=[
            ModelConfig(
                name="sonnet",
                provider="anthropic",
                model="claude-sonnet-4-5",
                api_base=upstream.url,
                api_key="k",
            )
        ],
        router=RouterConfig(
            num_retries=0,
            health_check_interval=0.3,
            health_check_timeout=0.5,
            breaker_failures=1,
            # long enough for the page to show `open` on a loaded machine; recovery comes from
            # the passing probe, which ends the cooldown
            breaker_cooldown=30.0,
        ),
        auth=AuthConfig(master_key=master_key),
        state_dir=tmp,
    )


@pytest.fixture
def upstream():
    u = Upstream().start()
    yield u
    if u.server is not None and not u.server.should_exit:
        u.kill()


def _chat(url: str, key: str) -> httpx.Response:
    return httpx.post(
        url + "/v1/messages",
        timeout=10,
        headers={"x-api-key": key, "anthropic-version": "2023-06-01"},
        json={"model": "sonnet", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]},
    )


def test_sign_in_is_the_master_keys_and_changes_need_the_csrf_token(upstream, tmp_path):
    gw = FakeServer(create_app(_config(upstream, tmp_path)), lifespan="on").start()
    try:
        key = create_key(gw.url, name="someone")["key"]
        c = httpx.Client(base_url=gw.url)
        assert c.get("/ui/api/requests").status_code == 401  # not signed in
        r = c.post("/ui/api/login", json={"key": key})
        # a normal key sees nothing
        assert r.status_code == 403 and "master key's" in r.json()["error"]["message"]
        assert c.post("/ui/api/login", json={"key": "wrong"}).status_code == 401
        r = c.post("/ui/api/login", json={"key": MASTER_KEY})
        assert r.status_code == 200
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie
        csrf = r.json()["csrf"]
        assert c.get("/ui/api/requests").status_code == 200  # the cookie signs GETs in
        assert c.post("/ui/api/keys", json={"name": "x"}).status_code == 403  # no CSRF token
        assert (
            c.post(
                "/ui/api/keys", json={"name": "x"}, headers={"x-csrf-token": "forged"}
            ).status_code
            == 403
        )
        evil = {"x-csrf-token": csrf, "origin": "https://evil.example"}
        assert c.post("/ui/api/keys", json={"name": "x"}, headers=evil).status_code == 403
        assert (
            c.post("/ui/api/keys", json={"name": ""}, headers={"x-csrf-token": csrf}).status_code
            == 400
        )
        made = c.post(
            "/ui/api/keys",
            json={"name": "x", "budget_month_usd": 10},
            headers={"x-csrf-token": csrf},
        )
        assert made.status_code == 200 and made.json()["key"].startswith("fsk_")
        budget = f"/ui/api/keys/{made.json()['id']}"
        assert c.post(budget, json={"budget_month_usd": 20}).status_code == 403  # no CSRF token
        changed = c.post(budget, json={"budget_month_usd": 20}, headers={"x-csrf-token": csrf})
        assert changed.status_code == 200 and changed.json()["budget_month_usd"] == 20
        refused = c.post(budget, json={"budget_month_usd": "lots"}, headers={"x-csrf-token": csrf})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "budget_month_usd"
        tampered = c.cookies.get("fs_console").replace(".", "9.", 1)
        assert (
            httpx.get(gw.url + "/ui/api/requests", cookies={"fs_console": tampered}).status_code
            == 401
        )
        page = c.get("/ui")
        assert "script-src 'self'" in page.headers["content-security-policy"]
    finally:
        gw.stop()
    off = FakeServer(
        create_app(_config(upstream, tmp_path / "off", master_key=None)), lifespan="on"
    ).start()
    try:
        assert httpx.get(off.url + "/ui/api/session").json()["enabled"] is False
        assert httpx.post(off.url + "/ui/api/login", json={"key": "x"}).status_code == 403
    finally:
        off.stop()


@pytest.mark.slow
def test_the_console_ships_inside_the_wheel(tmp_path):
    """A wheel built from the package holds the page, its script and its style: nothing is fetched
    or built at install time, and the page names only its own assets."""
    # a copy: a build in the shared tree would leave build/ and *.egg-info there
    src = tmp_path / "src"
    shutil.copytree(
        ROOT / "flashstack", src / "flashstack", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("flashstack-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        page = z.read("flashstack/gateway/ui/assets/index.html").decode()
    assert {
        f"flashstack/gateway/ui/assets/{a}" for a in ("index.html", "app.js", "style.css")
    } <= names
    assert re.findall(r'(?:src|href)="(/[^"]*)"', page) == [
        "/ui/assets/style.css",
        "/ui/assets/app.js",
    ]


@pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed (make install does it)"
)
def test_console_in_a_browser(upstream, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    shots = Path(os.environ.get("FLASHSTACK_UI_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    gw = FakeServer(create_app(_config(upstream, tmp_path)), lifespan="on").start()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
            )
            page = browser.new_page(viewport={"width": 1400, "height": 800})
            page.set_default_timeout(10_000)
            page.goto(gw.url + "/ui")
            page.screenshot(path=shots / "signin.png")
            # signed out, the nav is not shown: its visibility below is what proves the sign-in
            expect(page.locator("#signin")).to_be_visible()
            expect(page.locator("#nav")).to_be_hidden()
            page.fill("#master-key", MASTER_KEY)
            page.click("#signin-form button")
            expect(page.locator("#nav")).to_be_visible()  # signed in: the cookie is set by now
            cookies = {c["name"]: c for c in page.context.cookies()}
            assert (
                cookies["fs_console"]["httpOnly"] and cookies["fs_console"]["sameSite"] == "Strict"
            )

            health = page.locator('tr[data-id="sonnet#0"] td:nth-child(4)')
            expect(health).to_have_text("healthy")
            assert _chat(gw.url, MASTER_KEY).status_code == 200
            # one attempt seen
            expect(page.locator('tr[data-id="sonnet#0"] td:nth-child(7)')).to_have_text("1")
            page.screenshot(path=shots / "deployments.png")

            # the deployment goes unhealthy: its probes fail, a request opens its breaker
            upstream.kill()
            assert _chat(gw.url, MASTER_KEY).status_code == 502
            expect(health).to_have_text("unhealthy")
            expect(page.locator('tr[data-id="sonnet#0"] td:nth-child(5)')).to_have_text("open")
            page.screenshot(path=shots / "deployments-unhealthy.png")
            upstream.start()  # and recovers
            expect(health).to_have_text("healthy")

            page.click('nav a[href="#keys"]')
            page.fill('#key-form input[name="name"]', "ci-bot")
            page.fill('#key-form input[name="models"]', "sonnet")
            page.fill('#key-form input[name="budget_day_usd"]', "5")
            page.click("#key-form button")
            secret = page.locator("#new-secret").inner_text()
            assert secret.startswith("fsk_")
            ok = _chat(gw.url, secret)
            assert ok.status_code == 200
            request_id = ok.headers["x-request-id"]
            row = page.locator("tr", has_text="ci-bot")
            key_id = row.locator("td").first.inner_text()
            page.reload()
            expect(row.locator("td:nth-child(7)")).not_to_have_text("$0.0000")  # its spend shows
            # the budget changed: per day / per month
            page.once("dialog", lambda d: d.accept("7 / 50"))
            row.locator("button[data-budget]").click()
            expect(row.locator("td:nth-child(6)")).to_have_text("$7.0000 / $50.0000")
            page.screenshot(path=shots / "keys.png")
            page.once("dialog", lambda d: d.accept())
            row.locator("button[data-revoke]").click()
            expect(row.locator("td:nth-child(8)")).to_have_text("revoked")
            assert _chat(gw.url, secret).status_code == 401

            page.click('nav a[href="#requests"]')
            page.fill('#request-filter input[name="key"]', key_id)
            page.click("#request-filter button")
            found = page.locator("tbody tr", has_text=request_id)
            expect(found).to_have_count(1)
            found.click()
            opened = page.locator("#request-open")
            expect(opened).to_contain_text(request_id)
            expect(opened).to_contain_text("sonnet#0")
            page.screenshot(path=shots / "requests.png")

            session = httpx.post(
                gw.url + "/v1/sessions",
                json={"model": "sonnet", "metadata": {"user": "ada"}},
                headers=auth_headers(MASTER_KEY),
            ).json()
            r = httpx.post(
                f"{gw.url}/v1/sessions/{session['id']}/messages",
                headers=auth_headers(MASTER_KEY),
                json={"content": "What is a budget?", "max_tokens": 20},
                timeout=10,
            )
            assert r.status_code == 200, r.text
            page.click('nav a[href="#sessions"]')
            page.locator("tbody tr", has_text=session["id"]).click()
            expect(page.locator("#session-open")).to_contain_text("What is a budget?")
            expect(page.locator("#session-open")).to_contain_text("metered")
            page.screenshot(path=shots / "sessions.png")

            page.click('nav a[href="#spend"]')
            expect(page.locator("#spend-chart rect")).not_to_have_count(0)
            page.select_option("#group-by", "key_id")
            expect(page.locator(".legend")).to_contain_text(key_id)
            page.screenshot(path=shots / "spend.png")
            browser.close()
    finally:
        gw.stop()
