"""Every top-level row of fields.RESPONSES_REQUEST with a sample, sent through the gateway to a
chat-completions upstream: its documented fate is what happens (refused: a 400 naming it and
nothing sent; dropped: named in x-flashstack-dropped; mapped or the gateway's: neither)."""

from __future__ import annotations

import httpx
import pytest

from flashstack.gateway.translate import fields
from flashstack.gateway.translate.fields import Fate

ROWS = [f for f in fields.RESPONSES_REQUEST if f.sample is not None and f.name != "input"]


@pytest.mark.parametrize("row", ROWS, ids=[f.name for f in ROWS])
def test_each_field_meets_its_fate(gateway, keys, upstream, row):
    # a JSON reply: text.format holds
    body = {"model": "oai", "input": "[[json]] hi", row.name: row.sample}
    r = httpx.post(
        gateway.url + "/v1/responses", json=body, headers={"authorization": f"Bearer {keys[0]}"}
    )
    dropped = (r.headers.get("x-flashstack-dropped") or "").split(",")
    if row.cross is Fate.REFUSED:
        assert r.status_code == 400 and r.json()["error"]["param"] == row.name, r.text
        assert upstream["openai"].requests == []
        for harmless in row.harmless:
            ok = httpx.post(
                gateway.url + "/v1/responses",
                json={**body, row.name: harmless},
                headers={"authorization": f"Bearer {keys[0]}"},
            )
            assert ok.status_code == 200 and row.name not in ok.headers.get(
                "x-flashstack-dropped", ""
            ), ok.text
    elif row.cross is Fate.DROPPED:
        assert r.status_code == 200 and row.name in dropped, r.text
        assert row.name not in upstream["openai"].requests[-1].body
    else:
        assert r.status_code == 200 and row.name not in dropped, r.text
