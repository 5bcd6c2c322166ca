"""Models that see (issue 25): the lineup's `vision`, images sent upstream only to such models, the
`analyze_image` tool for the others, and the simulator's side of both wire formats."""

from __future__ import annotations

import base64
import io
import json

import httpx
import pytest
from PIL import Image

from chatserver.app import create_app
from chatserver.config import Settings
from gateway_sim.simulator import GatewaySimulator, Script, images_in, steps
from support import PixelServer


def models_of(lineup: dict) -> dict[str, dict]:
    return {m["id"]: m for t in lineup["tiers"] for m in t["models"]}


def png(width: int, height: int, color: str = "red") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, "PNG")
    return out.getvalue()


async def test_vision_comes_from_the_gateways_model_list_and_vision_models(tmp_path):
    # The simulator lists its models the OpenRouter way: architecture.input_modalities.
    with GatewaySimulator(models=["deepseek/deepseek-r1", "openai/gpt-5-nano"],
                          vision_models={"openai/gpt-5-mini"}) as sim:
        settings = Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data",
                            vision_models="openai/gpt-5")
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
                lineup = models_of((await client.get("/api/models")).json())
    assert lineup["openai/gpt-5-mini"]["vision"] is True  # the gateway says it takes images
    assert lineup["openai/gpt-5"]["vision"] is True  # VISION_MODELS says so
    assert lineup["openai/gpt-5-nano"]["vision"] is False  # listed as text only
    assert lineup["deepseek/deepseek-r1"]["vision"] is False


async def test_a_custom_models_vision_is_set_when_added_and_changed_in_settings(client):
    added = await client.post("/api/models", json={"id": "qwen/qwen2.5-vl", "tier": "fast", "vision": True})
    assert added.status_code == 201 and added.json()["vision"] is True
    assert models_of((await client.get("/api/models")).json())["qwen/qwen2.5-vl"]["vision"] is True

    changed = await client.patch("/api/models/qwen/qwen2.5-vl", json={"vision": False})
    assert changed.status_code == 200 and changed.json()["vision"] is False
    assert models_of((await client.get("/api/models")).json())["qwen/qwen2.5-vl"]["vision"] is False

    # Not a bool, a built-in model, an unknown one: refused, nothing changed.
    assert (await client.patch("/api/models/qwen/qwen2.5-vl", json={"vision": "yes"})).status_code == 422
    assert (await client.post("/api/models", json={"id": "x/y", "vision": 1})).status_code == 422
    built_in = await client.patch("/api/models/openai/gpt-5", json={"vision": False})
    assert built_in.status_code == 400 and "VISION_MODELS" in built_in.json()["detail"]
    assert (await client.patch("/api/models/no/such", json={"vision": True})).status_code == 404
    assert models_of((await client.get("/api/models")).json())["qwen/qwen2.5-vl"]["vision"] is False


def test_the_simulator_reads_image_parts_of_both_formats_and_refuses_malformed_ones(sim):
    data = base64.b64encode(png(40, 30)).decode()
    chat = {"model": "openai/gpt-5-mini", "stream": False, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}]}]}
    answered = httpx.post(sim.base_url + "/v1/chat/completions", json=chat)
    assert answered.status_code == 200
    assert "PNG image of 40×30 pixels" in answered.json()["choices"][0]["message"]["content"]
    (seen,) = sim.requests[-1].images
    assert (seen.shape, seen.format, seen.width, seen.height) == ("image_url", "PNG", 40, 30)

    messages = {"model": "anthropic/claude-haiku-4.5", "stream": True, "max_tokens": 100, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": data}},
                                     {"type": "text", "text": "and this?"}]}]}
    with httpx.stream("POST", sim.base_url + "/v1/messages", json=messages) as streamed:
        assert streamed.status_code == 200
        text = "".join(json.loads(line[5:])["delta"].get("text", "") for line in streamed.iter_lines()
                       if line.startswith("data:") and '"content_block_delta"' in line)
    assert "PNG image of 40×30 pixels" in text
    assert sim.requests[-1].images[0].shape == "image"

    # A JPEG declared as PNG, an image_url part on /v1/messages, and a text-only model given an image.
    wrong_type = {**messages, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": data}}]}]}
    assert httpx.post(sim.base_url + "/v1/messages", json=wrong_type).status_code == 400
    wrong_shape = {**messages, "messages": chat["messages"]}
    assert httpx.post(sim.base_url + "/v1/messages", json=wrong_shape).status_code == 400
    sim.models.add("deepseek/deepseek-r1")
    text_only = httpx.post(sim.base_url + "/v1/chat/completions", json={**chat, "model": "deepseek/deepseek-r1"})
    assert text_only.status_code == 404 and "support image input" in text_only.json()["error"]["message"]
    assert images_in({"messages": [{"role": "user", "content": "plain"}]}) == []



@pytest.fixture
def pixels():
    server = PixelServer()
    yield server
    server.close()


async def a_reply_showing(client, sim, address: str) -> str:
    conv = (await client.post("/api/conversations", json={})).json()
    await client.patch(f"/api/conversations/{conv['id']}", json={"settings": {"web_search": False, "web_fetch": False}})
    sim.enqueue(Script([steps.Text(f"Look: ![chart]({address})")]))
    await client.post(f"/api/conversations/{conv['id']}/messages", json={"content": "show it"})
    return conv["id"]


async def test_the_image_route_keeps_web_fetchs_address_rules(client, sim, pixels):
    address = f"http://127.0.0.1:{pixels.port}/pixel.png"
    conv_id = await a_reply_showing(client, sim, address)
    route = f"/api/conversations/{conv_id}/remote-image"

    # Production refuses private addresses, as web_fetch does: nothing reaches the loopback server.
    refused = await client.get(route, params={"url": address})
    assert refused.status_code == 403 and "public addresses only" in refused.json()["detail"]
    # An address no reply of this conversation shows, and a conversation that is not the person's.
    assert (await client.get(route, params={"url": "https://example.com/other.png"})).status_code == 404
    assert (await client.get("/api/conversations/nosuchconv1/remote-image", params={"url": address})).status_code == 404
    assert pixels.requests == []


async def test_the_image_route_answers_only_raster_images_typed_by_their_bytes(client, sim, app, pixels):
    app.state.chat.settings.fetch_allow_hosts = ["127.0.0.1"]  # as FETCH_ALLOW_HOSTS allows a test server
    address = f"http://127.0.0.1:{pixels.port}/pixel.png"
    conv_id = await a_reply_showing(client, sim, address)
    route = f"/api/conversations/{conv_id}/remote-image"

    shown = await client.get(route, params={"url": address})
    assert shown.status_code == 200 and shown.headers["content-type"] == "image/png"
    assert shown.content == pixels.png and shown.headers["x-content-type-options"] == "nosniff"

    # An SVG (a document that can carry script) declared as an image is not served from our origin.
    pixels.png, pixels.content_type = b"<svg xmlns='http://www.w3.org/2000/svg' onload='alert(1)'/>", "image/png"
    not_raster = await client.get(route, params={"url": address})
    assert not_raster.status_code == 502 and "not a PNG, JPEG, GIF or WebP" in not_raster.json()["detail"]
