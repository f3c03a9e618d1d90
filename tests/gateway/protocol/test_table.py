"""Generated from translate/fields.py: each top-level request field, on each path, meets its fate;
docs/protocols.md is the table's current rendering."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from flashstack.gateway.translate import fields
from flashstack.gateway.translate.fields import Fate
from tests.gateway.protocol.conftest import CLIENT_KEY

DOC = Path(__file__).resolve().parents[3] / "docs" / "protocols.md"
# (client wire, path, model of that wire, model of the other wire, minimal body)
WIRES = {
    "openai": (
        "/v1/chat/completions",
        "oai",
        "claude",
        {"messages": [{"role": "user", "content": "hi"}]},
    ),
    "anthropic": (
        "/v1/messages",
        "claude",
        "oai",
        {"max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]},
    ),
}
TABLES = {"openai": fields.OPENAI_REQUEST, "anthropic": fields.ANTHROPIC_REQUEST}
PART_TABLES = {"openai": fields.OPENAI_PARTS, "anthropic": fields.ANTHROPIC_PARTS}


def _rows(fate_filter) -> list:
    return [
        pytest.param(wire, row, id=f"{wire}:{row.name}")
        for wire, table in TABLES.items()
        for row in table
        if row.sample is not None and fate_filter(row)
    ]


def _post(gateway, wire: str, model: str, **extra) -> httpx.Response:
    path, _, _, body = WIRES[wire]
    headers = {
        "authorization": f"Bearer {CLIENT_KEY}",
        "x-api-key": CLIENT_KEY,
        "anthropic-version": "2023-06-01",
    }
    return httpx.post(
        gateway.url + path, json={"model": model, **body, **extra}, headers=headers, timeout=20
    )


def test_the_doc_is_the_table():
    assert DOC.read_text() == fields.render_markdown(), (
        "docs/protocols.md is stale: python -m flashstack.gateway.translate.fields > "
        "docs/protocols.md"
    )


@pytest.mark.parametrize("wire,row", _rows(lambda r: r.same is Fate.PASSED))
def test_same_wire_passes_the_field_as_sent(protocol_gateway, answered, wire, row):
    r = _post(protocol_gateway, wire, WIRES[wire][1], **{row.name: row.sample})
    assert r.status_code == 200, r.text
    sent = answered[wire].requests[-1].body
    assert sent[row.name] == row.sample
    assert "x-flashstack-dropped" not in r.headers


def _request_dropped(headers) -> list[str]:
    """The request's fields named in x-flashstack-dropped (the response's, `response.…`, aside:
    test_response_dropped.py)."""
    names = filter(None, headers.get("x-flashstack-dropped", "").split(","))
    return [n for n in names if not n.startswith(fields.RESPONSE_PREFIX)]


@pytest.mark.parametrize("wire,row", _rows(lambda r: r.cross is Fate.REFUSED))
def test_across_wires_a_field_relied_on_is_refused_by_name(protocol_gateway, answered, wire, row):
    other = "anthropic" if wire == "openai" else "openai"
    before = len(answered[other].requests)
    r = _post(protocol_gateway, wire, WIRES[wire][2], **{row.name: row.sample})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert row.name in message and "cannot be sent" in message
    assert len(answered[other].requests) == before  # refused before anything went upstream


@pytest.mark.parametrize("wire,row", _rows(lambda r: r.cross is Fate.DROPPED))
def test_across_wires_an_optimisation_is_dropped_and_named(protocol_gateway, answered, wire, row):
    other = "anthropic" if wire == "openai" else "openai"
    r = _post(protocol_gateway, wire, WIRES[wire][2], **{row.name: row.sample})
    assert r.status_code == 200, r.text
    assert row.name in _request_dropped(r.headers)
    sent = answered[other].requests[-1].body
    # not sent as such (a field of the same name is the target's own)
    assert sent.get(row.name) != row.sample


@pytest.mark.parametrize("wire,row", _rows(lambda r: r.cross is Fate.MAPPED and r.name != "model"))
def test_across_wires_a_mapped_field_is_taken_silently(protocol_gateway, answered, wire, row):
    r = _post(protocol_gateway, wire, WIRES[wire][2], **{row.name: row.sample})
    assert r.status_code == 200, r.text
    assert not _request_dropped(r.headers)


@pytest.mark.parametrize(
    "wire,row,value",
    [
        pytest.param(w, row, v, id=f"{w}:{row.name}={v}")
        for w, t in TABLES.items()
        for row in t
        for v in row.harmless
    ],
)
def test_across_wires_a_value_that_asks_for_nothing_is_neither_refused_nor_named(
    protocol_gateway, answered, wire, row, value
):
    r = _post(protocol_gateway, wire, WIRES[wire][2], **{row.name: value})
    assert r.status_code == 200, r.text
    assert row.name not in _request_dropped(r.headers)


def test_a_field_newer_than_the_table_is_dropped_and_named_across_wires(protocol_gateway, answered):
    r = _post(protocol_gateway, "openai", "claude", x_future_field=1)
    assert r.status_code == 200 and _request_dropped(r.headers) == ["x_future_field"]
    r = _post(protocol_gateway, "openai", "oai", x_future_field=1)
    assert (
        answered["openai"].requests[-1].body["x_future_field"] == 1
        and "x-flashstack-dropped" not in r.headers
    )


# ---- part rows: each sample is a body fragment (messages, system or tools) carrying the part -----


def _part_rows() -> list:
    return [
        pytest.param(wire, row, id=f"{wire}:{row.name}")
        for wire, table in PART_TABLES.items()
        for row in table
    ]


@pytest.mark.parametrize("wire,row", _part_rows())
def test_same_wire_passes_the_part_as_sent(protocol_gateway, answered, wire, row):
    r = _post(protocol_gateway, wire, WIRES[wire][1], **row.sample)
    assert r.status_code == 200, r.text
    sent = answered[wire].requests[-1].body
    assert {k: sent[k] for k in row.sample} == row.sample
    assert "x-flashstack-dropped" not in r.headers


@pytest.mark.parametrize("wire,row", _part_rows())
def test_across_wires_the_part_meets_its_fate(protocol_gateway, answered, wire, row):
    other = "anthropic" if wire == "openai" else "openai"
    before = len(answered[other].requests)
    r = _post(protocol_gateway, wire, WIRES[wire][2], **row.sample)
    if row.cross is Fate.REFUSED:
        assert r.status_code == 400 and row.name in r.json()["error"]["message"], r.text
        assert len(answered[other].requests) == before
        return
    assert r.status_code == 200, r.text
    dropped = _request_dropped(r.headers)
    assert (row.name in dropped) is (row.cross is Fate.DROPPED), dropped
