"""A request `kvbank picker` routed carries its hold as `x-kvbank-hold`: the engine takes it as
the request's id, so its sidecar's view of the submit releases the picker's hold."""

from __future__ import annotations

from conftest import LiveServer

BODY = {"prompt": "page cache", "max_tokens": 2}


def test_the_pickers_id_becomes_the_request_id(server: LiveServer) -> None:
    hold = "cmpl-" + "ab" * 16
    reply = server.client.post("/v1/completions", json=BODY, headers={"x-kvbank-hold": hold})
    assert reply.status_code == 200 and reply.json()["id"] == hold


def test_an_id_not_in_the_pickers_form_is_ignored(server: LiveServer) -> None:
    for hold in ("cmpl-short", "chatcmpl-" + "ab" * 16, "cmpl-" + "AB" * 16, "x" * 5000):
        reply = server.client.post("/v1/completions", json=BODY, headers={"x-kvbank-hold": hold})
        assert reply.status_code == 200
        assert reply.json()["id"] != hold and reply.json()["id"].startswith("cmpl-")
