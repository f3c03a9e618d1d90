"""What an upstream fake received: the images of the last request, as (media type, base64)."""

from __future__ import annotations

UPSTREAM_OF = {
    "claude": "anthropic",
    "claude-small": "anthropic",
    "gpt": "openai",
    "llama": "ollama",
}


def forwarded_images(upstreams, model: str) -> list[tuple[str | None, str]]:
    # The last chat request: health probes (GET /v1/models) are recorded too.
    body = next(
        r.body
        for r in reversed(upstreams[UPSTREAM_OF[model]].requests)
        if isinstance(r.body, dict) and "messages" in r.body
    )
    last = body["messages"][-1]
    if UPSTREAM_OF[model] == "ollama":
        return [(None, data) for data in last.get("images", [])]
    out = []
    for part in last["content"] if isinstance(last["content"], list) else []:
        if part["type"] == "image":
            out.append((part["source"]["media_type"], part["source"]["data"]))
        elif part["type"] == "image_url":
            header, _, data = part["image_url"]["url"].partition(",")
            out.append((header[5:-7], data))
    return out


def chat_request_count(upstreams) -> int:
    return sum(1 for s in upstreams.values() for r in s.requests if r.method == "POST")
