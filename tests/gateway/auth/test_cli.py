"""`flashstack keys create|list|revoke` against the database a running gateway reads."""

from __future__ import annotations

import json

import openai
import pytest
import yaml

from flashstack.cli import main
from tests.gateway.sessions.support import ScratchStore, gateway_config, start_gateway


def _run(capsys, *argv: str) -> list[dict]:
    main(list(argv))
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_keys_cli_round_trip(upstreams, tmp_path, capsys):
    store = ScratchStore("sqlite", tmp_path)
    config_file = tmp_path / "flashstack.yaml"
    config_file.write_text(yaml.safe_dump({"store": {"database_url": store.url}}))
    [created] = _run(
        capsys,
        "keys",
        "create",
        "--config",
        str(config_file),
        "--name",
        "cli",
        "--models",
        "gpt,claude",
        "--rpm",
        "2",
        "--expires-in",
        "1d",
    )
    assert (
        created["key"].startswith("fsk_")
        and created["models"] == ["gpt", "claude"]
        and created["rpm"] == 2
    )
    assert created["expires_at"] > created["created_at"] + 86000
    listed = _run(capsys, "keys", "list", "--config", str(config_file))
    assert [k["id"] for k in listed] == [created["id"]] and "key" not in listed[0]

    server = start_gateway(gateway_config(upstreams, store, tmp_path))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=created["key"], max_retries=0)
        out = client.chat.completions.create(
            model="gpt", messages=[{"role": "user", "content": "hi"}]
        )
        assert out.choices[0].message.content == "echo: hi"
        [revoked] = _run(capsys, "keys", "revoke", "--config", str(config_file), created["id"])
        assert revoked["revoked_at"] is not None
        with pytest.raises(openai.AuthenticationError, match="revoked"):
            client.chat.completions.create(
                model="gpt", messages=[{"role": "user", "content": "hi"}]
            )
    finally:
        server.stop()


@pytest.mark.parametrize(
    "argv",
    [
        ["keys", "create", "--name", "x", "--expires-in", "soon"],
        ["keys", "create", "--name", "x", "--rpm", "0"],
        ["keys", "revoke", "key_missing"],
    ],
)
def test_keys_cli_refuses_bad_input(tmp_path, capsys, argv):
    config_file = tmp_path / "flashstack.yaml"
    config_file.write_text(
        yaml.safe_dump({"store": {"database_url": f"sqlite+aiosqlite:///{tmp_path}/k.db"}})
    )
    with pytest.raises(SystemExit) as e:
        main([*argv, "--config", str(config_file)])
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err
    main(["keys", "list", "--config", str(config_file)])
    assert capsys.readouterr().out == ""
