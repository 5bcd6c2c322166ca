"""Presets through the real app: built-ins read-only with their tool whitelists, custom presets
created, replaced and deleted in the data directory, and bad input refused without changing anything."""

from __future__ import annotations

import json

import pytest

from chatserver.conversations.presets import Presets
from chatserver.store.files import FileStore
from chatserver.tools import registry as tools


async def test_builtins_list_their_whitelists_and_default_allows_the_unconfigured_local_tools(client):
    response = await client.get("/api/presets")
    assert response.status_code == 200
    listed = {p["name"]: p for p in response.json()}
    assert {"default", "coder", "concise", "translator"} <= set(listed)
    assert all(p["builtin"] and p["text"] for p in listed.values())
    # Every local tool that needs no configuration (web_search needs SEARXNG_URL), and
    # analyze_image, offered only once VISION_MODEL is set.
    unconfigured = [t.name for t in map(tools.registry.get, tools.registry.names()) if t.requires is None]
    assert sorted(listed["default"]["tools"]) == sorted([*unconfigured, "analyze_image"])
    assert "web_search" not in listed["default"]["tools"]
    assert listed["translator"]["tools"] == []
    assert "model" not in listed["default"]
    # The persona text is the .txt alone: no header of tool names leaks into the system prompt.
    assert "remember" not in listed["default"]["text"]


async def test_a_custom_preset_is_created_replaced_and_deleted(client, settings):
    body = {"name": "Research buddy", "text": "You dig into sources.", "tools": ["web_fetch", "remember"],
            "model": "openai/gpt-5-mini"}
    created = await client.post("/api/presets", json=body)
    assert created.status_code == 201, created.text
    assert created.json() == {**body, "builtin": False}
    stored = json.loads((settings.data_dir / "presets.json").read_text())
    assert stored == {"schema_version": 1, "presets": [body]}

    listed = (await client.get("/api/presets")).json()
    assert listed[-1] == {**body, "builtin": False}
    assert [p["builtin"] for p in listed] == [True] * (len(listed) - 1) + [False]

    replaced = await client.put("/api/presets/Research buddy",
                                json={"name": "Research buddy", "text": "Cite everything.", "tools": ["web_fetch"]})
    assert replaced.status_code == 200
    assert replaced.json() == {"name": "Research buddy", "text": "Cite everything.", "tools": ["web_fetch"],
                               "builtin": False}

    renamed = await client.put("/api/presets/Research%20buddy",
                               json={"name": "Reader", "text": "Cite everything.", "tools": []})
    assert renamed.status_code == 200
    names = [p["name"] for p in (await client.get("/api/presets")).json()]
    assert "Reader" in names and "Research buddy" not in names

    assert (await client.delete("/api/presets/Reader")).status_code == 204
    assert json.loads((settings.data_dir / "presets.json").read_text())["presets"] == []
    assert (await client.delete("/api/presets/Reader")).status_code == 404


@pytest.mark.parametrize("method, path, body", [
    ("put", "/api/presets/default", {"name": "default", "text": "Changed.", "tools": []}),
    ("delete", "/api/presets/default", None),
    ("post", "/api/presets", {"name": "Default", "text": "Mine now.", "tools": []}),
])
async def test_builtins_cannot_be_changed_or_deleted(client, settings, method, path, body):
    response = await getattr(client, method)(path, **({"json": body} if body is not None else {}))
    assert response.status_code == 400
    assert "built-in" in response.json()["detail"]
    assert not (settings.data_dir / "presets.json").exists()
    default = next(p for p in (await client.get("/api/presets")).json() if p["name"] == "default")
    assert default["text"].startswith("You are a helpful, precise assistant.")


@pytest.mark.parametrize("body, fragment", [
    ({"name": "../etc/passwd", "text": "x", "tools": []}, "name"),
    ({"name": "", "text": "x", "tools": []}, "name"),
    ({"name": "x" * 65, "text": "x", "tools": []}, "name"),
    ({"name": " padded", "text": "x", "tools": []}, "space"),
    ({"name": "ok", "text": "x", "tools": ["rm_rf"]}, "no such tool: rm_rf"),
    ({"name": "ok", "text": "   ", "tools": []}, "empty"),
    ({"name": "ok", "text": "x", "tools": [], "shell": True}, "shell"),
])
async def test_bad_presets_are_422_and_change_nothing(client, settings, body, fragment):
    response = await client.post("/api/presets", json=body)
    assert response.status_code == 422, response.text
    assert fragment in response.json()["detail"]
    assert not (settings.data_dir / "presets.json").exists()


async def test_duplicate_names_conflict_and_unknown_ones_are_404(client):
    body = {"name": "Mine", "text": "x", "tools": []}
    assert (await client.post("/api/presets", json=body)).status_code == 201
    again = await client.post("/api/presets", json={**body, "name": "mine"})
    assert again.status_code == 409
    missing = await client.put("/api/presets/Nobody", json=body)
    assert missing.status_code == 404


async def test_a_damaged_presets_file_is_left_untouched(client, settings):
    path = settings.data_dir / "presets.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    response = await client.post("/api/presets", json={"name": "Mine", "text": "x", "tools": []})
    assert response.status_code == 409 and "damaged" in response.json()["detail"]
    assert path.read_text() == "{not json"


async def test_tools_a_server_does_not_register_are_left_out_when_reading(tmp_path):
    builtin = tmp_path / "builtin"
    builtin.mkdir()
    (builtin / "helper.txt").write_text("Be helpful.\n")
    (builtin / "presets.json").write_text(json.dumps({"_about": "comment", "helper": {
        "tools": ["remember", "search_attachments"], "model": "vendor/model"}}))
    presets = Presets(FileStore(tmp_path / "data").for_owner("local"), ["remember", "web_fetch"], builtin_dir=builtin)
    assert [p.out() for p in await presets.entries()] == [
        {"name": "helper", "text": "Be helpful.", "tools": ["remember"], "builtin": True, "model": "vendor/model"}]


async def test_the_tools_route_lists_schemas_runtimes_and_failure_counts(client):
    listed = (await client.get("/api/tools")).json()
    local = {t["name"]: t for t in listed if t["runs"] == "local"}
    assert {"remember", "web_fetch", "web_search"} <= set(local)
    assert local["web_fetch"]["parameters"]["required"] == ["url"]
    assert local["web_search"]["available"] is False  # no SEARXNG_URL in the test settings
    assert all(isinstance(t["failures"], int) for t in listed)
    assert {t["name"] for t in listed if t["runs"] == "gateway"} == {"web_search", "web_fetch"}
