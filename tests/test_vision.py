"""Models that see (issue 25): the lineup's `vision`, images sent upstream only to such models, the
`analyze_image` tool for the others, and the simulator's side of both wire formats."""

from __future__ import annotations

import base64
import dataclasses
import json

import httpx
import pytest

from chatserver.app import create_app
from chatserver.config import Settings
from gateway_sim.simulator import GatewaySimulator, Script, Usage, images_in, steps
from support import PixelServer, names, parse_sse, png


def models_of(lineup: dict) -> dict[str, dict]:
    return {m["id"]: m for t in lineup["tiers"] for m in t["models"]}


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


def test_the_lineup_always_holds_the_models_the_server_calls_itself():
    settings = Settings(_env_file=None, models="fast:openai/gpt-5-nano", default_model="openai/gpt-5-mini",
                        summarizer_model="mistral/small", vision_model="qwen/qwen2.5-vl")
    lineup = {m.id: m for m in settings.lineup()}
    assert list(lineup) == ["openai/gpt-5-nano", "openai/gpt-5-mini", "mistral/small", "qwen/qwen2.5-vl"]
    assert lineup["qwen/qwen2.5-vl"].vision and not lineup["openai/gpt-5-mini"].vision
    assert [m.id for m in Settings(_env_file=None, models="fast:openai/gpt-5-nano,openai/gpt-5-mini").lineup()] \
        == ["openai/gpt-5-nano", "openai/gpt-5-mini"]  # nothing twice, and no VISION_MODEL unless set


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
    assert shown.headers["content-security-policy"] == "default-src 'none'; sandbox"

    # An SVG (a document that can carry script) declared as an image is not served from our origin.
    pixels.png, pixels.content_type = b"<svg xmlns='http://www.w3.org/2000/svg' onload='alert(1)'/>", "image/png"
    not_raster = await client.get(route, params={"url": address})
    assert not_raster.status_code == 502 and "not a PNG, JPEG, GIF or WebP" in not_raster.json()["detail"]


# --- Images sent upstream, and the tool for models without eyes ---------------------------------

VISION_MODEL = "openai/gpt-5-mini"  # listed by the simulator with image input
BLIND_MODEL = "deepseek/deepseek-r1"  # not: its images go through analyze_image


@pytest.fixture
def settings(tmp_path, sim) -> Settings:
    return Settings(_env_file=None, gateway_base_url=sim.base_url, data_dir=tmp_path / "data", upstream_timeout=5,
                    vision_model=VISION_MODEL)


async def conversation(client, model: str, *, web: bool = False) -> str:
    conv = (await client.post("/api/conversations", json={"model": model})).json()
    await client.patch(f"/api/conversations/{conv['id']}", json={"settings": {"web_search": web, "web_fetch": False}})
    return conv["id"]


async def attach(client, conv_id: str, data: bytes, name: str = "photo.png") -> str:
    answer = await client.post(f"/api/conversations/{conv_id}/attachments",
                               files={"file": (name, data, "application/octet-stream")})
    assert answer.status_code == 201, answer.text
    return answer.json()["id"]


async def say(client, conv_id: str, content: str, attachment_ids: list[str] = ()) -> list[tuple[str, dict]]:
    answer = await client.post(f"/api/conversations/{conv_id}/messages",
                               json={"content": content, "attachment_ids": list(attachment_ids)})
    assert answer.status_code == 200, answer.text
    return parse_sse(answer.text)


def sent_text(body: dict) -> str:
    """Every text a request carried, whichever format."""
    out = []
    for m in body["messages"]:
        content = m.get("content")
        out += [content] if isinstance(content, str) else [p.get("text", "") for p in content or () if isinstance(p, dict)]
    return "\n".join(out)


def declared(body: dict) -> list[str]:
    return [t.get("name") or t.get("function", {}).get("name") for t in body.get("tools") or ()]


async def test_a_vision_model_gets_the_image_scaled_on_chat_completions(client, sim, app):
    children = app.state.chat.attachments.extractor
    conv_id = await conversation(client, VISION_MODEL)
    aid = await attach(client, conv_id, png(3000, 2000))
    uploaded = children.started
    sim.enqueue(Script([steps.Text("A red rectangle.")]))
    await say(client, conv_id, "What is in this picture?", [aid])
    assert children.started == uploaded + 1  # scaled in a limited child, not in the server

    request = sim.requests[-1]
    assert request.path == "/v1/chat/completions"
    (image,) = request.images
    # Drawn smaller in the attachments' limited child, as a WebP (a thumbnail's way).
    assert (image.shape, image.format, image.width, image.height) == ("image_url", "WEBP", 1568, 1045)
    user = request.body["messages"][-1]["content"]
    assert [p["type"] for p in user] == ["image_url", "text"]  # the image first, then the question
    assert set(user[0]) == {"type", "image_url"}  # nothing of ours (the estimate) leaks upstream

    # The next turn sends it again (it is still in the prompt), scaled once; a small image goes as stored.
    small = await attach(client, conv_id, png(30, 20, "blue"))
    stored = (await client.get(f"/api/conversations/{conv_id}/attachments/{small}")).content
    started = children.started
    sim.enqueue(Script([steps.Text("Blue.")]))
    await say(client, conv_id, "And this one?", [small])
    assert children.started == started
    big, little = sim.requests[-1].images
    assert (big.width, little.format, little.width) == (1568, "PNG", 30)
    parts = [p for m in sim.requests[-1].body["messages"] if isinstance(m["content"], list) for p in m["content"]
             if p["type"] == "image_url"]
    assert parts[-1]["image_url"]["url"] == "data:image/png;base64," + base64.b64encode(stored).decode()


async def test_a_vision_model_gets_the_image_as_a_messages_block(client, sim, app):
    app.state.chat.settings.image_max_edge = 500
    conv_id = await conversation(client, "anthropic/claude-haiku-4.5", web=True)  # web search: /v1/messages
    aid = await attach(client, conv_id, png(800, 1200))
    sim.enqueue(Script([steps.Text("Tall and red.")]))
    await say(client, conv_id, "Describe it", [aid])

    request = sim.requests[-1]
    assert request.path == "/v1/messages"
    (image,) = request.images
    assert (image.shape, image.width, image.height) == ("image", 333, 500)
    block = request.body["messages"][-1]["content"][0]
    assert block["type"] == "image" and block["source"]["type"] == "base64"
    assert block["source"]["media_type"] == "image/webp"


async def test_a_blind_model_is_never_sent_images_and_asks_vision_model_instead(client, sim):
    conv_id = await conversation(client, BLIND_MODEL)
    aid = await attach(client, conv_id, png(2400, 1600, "green"))
    sim.enqueue(
        Script([steps.ToolCall("analyze_image", {"image_id": aid, "question": "What colour is it?"})],
               usage=Usage(prompt=500, completion=20, cost=0.002, dialect="openrouter")),
        Script([steps.Text("It is entirely green.")], usage=Usage(prompt=1200, completion=6, cost=0.003,
                                                                   dialect="openrouter")),
        Script([steps.Text("The picture is green.")], usage=Usage(prompt=300, completion=5, cost=0.001,
                                                                    dialect="openrouter")),
    )
    events = await say(client, conv_id, "What colour is my picture?", [aid])

    first, vision, last = sim.requests[-3:]
    assert first.images == [] and last.images == []
    assert "analyze_image" in declared(first.body)
    assert f"(id {aid}, 2400 × 1600 PNG)" in sent_text(first.body)
    assert vision.body["model"] == VISION_MODEL and vision.body.get("stream") is not True
    (seen,) = vision.images
    assert (seen.width, seen.height) == (1568, 1045)
    assert "What colour is it?" in sent_text(vision.body)
    assert "It is entirely green." in sent_text(last.body)  # the tool's answer went back to the model

    done = next(data for name, data in events if name == "tool" and data["status"] == "done")
    assert done["name"] == "analyze_image" and done["usage"]["model"] == VISION_MODEL
    assert done["usage"]["cost"] == pytest.approx(0.003)
    # The vision call is the turn's: in the reply's usage and the conversation's totals.
    (_, finished) = next((n, d) for n, d in events if n == "done")
    assert finished["usage"]["cost"] == pytest.approx(0.006)
    assert finished["usage"]["input_tokens"] >= 500 + 1200 + 300
    totals = (await client.get(f"/api/conversations/{conv_id}")).json()["totals"]
    assert totals["cost"] == pytest.approx(0.006)


async def test_another_conversations_image_is_not_found_to_the_tool(client, sim):
    elsewhere = await conversation(client, BLIND_MODEL)
    theirs = await attach(client, elsewhere, png(40, 40, "black"))
    conv_id = await conversation(client, BLIND_MODEL)
    mine = await attach(client, conv_id, png(40, 40, "white"))
    sim.enqueue(Script([steps.ToolCall("analyze_image", {"image_id": theirs, "question": "What is it?"})]),
                Script([steps.Text("I could not see it.")]))
    events = await say(client, conv_id, "Look at my picture", [mine])

    failed = next(data for name, data in events if name == "tool" and data["status"] == "error")
    assert "not found" in failed["error"]
    assert all(r.body["model"] == BLIND_MODEL for r in sim.requests[-2:])  # VISION_MODEL was never asked
    assert not any(r.images for r in sim.requests)


async def test_analyze_image_is_offered_only_for_images_to_a_model_without_eyes(client, sim):
    conv_id = await conversation(client, BLIND_MODEL)
    sim.enqueue(Script([steps.Text("Hello.")]))
    await say(client, conv_id, "Hi")
    assert "analyze_image" not in declared(sim.requests[-1].body)  # no image yet

    seeing = await conversation(client, VISION_MODEL)
    aid = await attach(client, seeing, png(30, 30))
    sim.enqueue(Script([steps.Text("Small.")]))
    await say(client, seeing, "And this?", [aid])
    assert "analyze_image" not in declared(sim.requests[-1].body)  # it sees the image itself


async def test_the_projection_and_context_bar_count_images_until_compression_folds_them(client, sim):
    conv_id = await conversation(client, VISION_MODEL)
    aid = await attach(client, conv_id, png(2048, 1024))
    before = (await client.get(f"/api/conversations/{conv_id}")).json()["context"]
    sim.enqueue(Script([steps.Text("A wide red image.")], usage="omit"))
    await say(client, conv_id, "What is this?", [aid])
    context = (await client.get(f"/api/conversations/{conv_id}")).json()["context"]
    # OpenAI's rule for 1568 x 784 as sent: shortest side 768 -> 1536 x 768 -> 3 x 2 tiles.
    assert context["images"] == 85 + 170 * 6
    assert context["history"] >= before["history"] + context["images"]

    # Compression folds the turn: the image leaves the prompt, and the summarizer is told it was there.
    for n in range(5):
        sim.enqueue(Script([steps.Text(f"Reply {n}.")]))
        await say(client, conv_id, f"Next question {n}")
    sim.enqueue(Script([steps.Text('{"summary": "The person showed photo.png, a wide red image.", "facts": []}')]))
    assert (await client.post(f"/api/conversations/{conv_id}/compress")).status_code == 200
    assert "[image attached: photo.png (image, 2048 × 1024 PNG)]" in sent_text(sim.requests[-1].body)
    assert "A wide red image." in sent_text(sim.requests[-1].body)  # what was said about it goes too
    assert (await client.get(f"/api/conversations/{conv_id}")).json()["context"]["images"] == 0
    sim.enqueue(Script([steps.Text("Still here.")]))
    await say(client, conv_id, "Do you remember the picture?")
    assert sim.requests[-1].images == []
    assert "wide red image" in json.dumps(sim.requests[-1].body["messages"][0])  # the summary, in the system layers


async def test_an_image_the_model_returns_is_kept_as_the_replys_attachment(client, sim):
    conv_id = await conversation(client, VISION_MODEL)
    sim.enqueue(Script([steps.Text("Here is your drawing:"), steps.ImageOut(png(64, 48, "yellow"))]))
    events = await say(client, conv_id, "Draw me a yellow box")

    (attached,) = [data["attachment"] for name, data in events if name == "image"]
    assert attached["kind"] == "image" and (attached["width"], attached["height"]) == (64, 48)
    reply = (await client.get(f"/api/conversations/{conv_id}")).json()["messages"][-1]
    assert reply["attachment_ids"] == [attached["id"]]
    listed = (await client.get(f"/api/conversations/{conv_id}/attachments")).json()
    assert [a["id"] for a in listed] == [attached["id"]]
    thumbnail = await client.get(f"/api/conversations/{conv_id}/attachments/{attached['id']}/thumbnail")
    assert thumbnail.status_code == 200


async def test_an_output_image_that_is_not_an_image_is_a_warning_never_a_stored_document(client, sim):
    """The upload's readers would store a PDF labelled image/png as a document, announced as an image."""
    from test_attachments import make_pdf

    conv_id = await conversation(client, VISION_MODEL)
    sim.enqueue(Script([steps.Text("Here:"), steps.ImageOut(make_pdf(["A readable page of words."])),
                        steps.ImageOut(b"just some words, not pixels\n" * 10)]))
    events = await say(client, conv_id, "Draw")

    assert names(events)[-1] == "done" and "image" not in names(events)
    warnings = [data for name, data in events if name == "warning"]
    assert [w["code"] for w in warnings] == ["image_not_kept", "image_not_kept"]
    assert all("not a PNG, JPEG, GIF or WebP" in w["message"] for w in warnings)
    assert (await client.get(f"/api/conversations/{conv_id}/attachments")).json() == []


async def test_the_demo_gateway_answers_about_an_attached_image(tmp_path):
    # No GATEWAY_BASE_URL: the built-in demo, whose model list says the default model sees.
    app = create_app(Settings(_env_file=None, data_dir=tmp_path / "data"))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1",
                                     timeout=30) as client:
            assert models_of((await client.get("/api/models")).json())["openai/gpt-5-mini"]["vision"] is True
            conv_id = await conversation(client, "openai/gpt-5-mini")
            aid = await attach(client, conv_id, png(2000, 500, "purple"), "banner.png")
            events = await say(client, conv_id, "What is this?", [aid])
    reply = "".join(data["text"] for name, data in events if name == "delta")
    assert "SIMULATED look at an image" in reply
    assert "a WEBP image of 1568×392 pixels" in reply  # as sent: scaled to IMAGE_MAX_EDGE


async def test_an_image_in_the_files_but_in_no_message_is_listed_with_its_id_for_the_tool(client, sim):
    conv_id = await conversation(client, BLIND_MODEL)
    aid = await attach(client, conv_id, png(50, 50, "orange"), "logo.png")
    sim.enqueue(Script([steps.Text("I see a file.")]))
    await say(client, conv_id, "What files do I have?")
    body = sim.requests[-1].body
    assert "analyze_image" in declared(body)
    assert f"- logo.png (image, 50 × 50 PNG, id {aid})" in json.dumps(body["messages"][0], ensure_ascii=False)


async def test_the_gateways_model_list_unreachable_leaves_the_lineup_as_configured(tmp_path):
    # Nothing listens there: the list is not read, VISION_MODELS still counts, and nobody waits long.
    settings = Settings(_env_file=None, gateway_base_url="http://127.0.0.1:9", data_dir=tmp_path / "data",
                        vision_models="openai/gpt-5")
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            lineup = models_of((await client.get("/api/models")).json())
    assert lineup["openai/gpt-5"]["vision"] is True and lineup["openai/gpt-5-mini"]["vision"] is False


async def test_an_image_the_child_cannot_scale_leaves_a_note_and_the_turn_goes_on(client, sim, app):
    conv_id = await conversation(client, VISION_MODEL)
    aid = await attach(client, conv_id, png(3000, 2000))
    attachments = app.state.chat.attachments
    attachments.limits = dataclasses.replace(attachments.limits, max_image_pixels=1_000_000)  # the child refuses it now
    sim.enqueue(Script([steps.Text("I cannot see it.")]))
    events = await say(client, conv_id, "What is this?", [aid])
    assert [name for name, _ in events][-1] == "done"
    assert sim.requests[-1].images == []
    assert "[Attached image photo.png could not be sent: " in sent_text(sim.requests[-1].body)


async def test_a_measured_prompt_replaces_the_image_estimate(client, sim):
    conv_id = await conversation(client, VISION_MODEL)
    aid = await attach(client, conv_id, png(1024, 1024))
    sim.enqueue(Script([steps.Text("Square.")], usage=Usage(prompt=2000, completion=10, dialect="openrouter")))
    await say(client, conv_id, "Shape?", [aid])
    context = (await client.get(f"/api/conversations/{conv_id}")).json()["context"]
    assert context["measured"] is True and context["images"] == 85 + 170 * 4  # 768 x 768: 2 x 2 tiles
    # The image is inside the measured 2,000: counted once, by the gateway's number, not again by ours.
    assert context["history"] == 2000 + 10 - context["persona"] - context["memory"] - context["summary"]
