"""A Content-Security-Policy on every answer, which the page (no inline script) costs nothing to meet."""

from __future__ import annotations

import re

import pytest

from chatserver.api.guard import CONTENT_SECURITY_POLICY
from chatserver.api.site import STATIC
from gateway_sim.simulator import Script, steps
from support import parse_sse


def directives(header: str) -> dict[str, list[str]]:
    out = {}
    for part in header.split(";"):
        name, *values = part.split()
        out[name] = values
    return out


@pytest.mark.parametrize("method,path,headers", [
    ("GET", "/", {}), ("GET", "/static/app.js", {}), ("GET", "/static/style.css", {}),
    ("GET", "/healthz", {}), ("GET", "/api/conversations", {}), ("GET", "/openapi.json", {}),
    ("GET", "/no-such-page", {}), ("GET", "/api/conversations/nope", {}),
    ("GET", "/", {"host": "evil.example"}),  # refused by the Host check, still with the header
])
async def test_every_answer_carries_the_content_security_policy(client, method, path, headers):
    response = await client.request(method, path, headers=headers)

    policy = directives(response.headers["content-security-policy"])
    assert policy["default-src"] == ["'self'"] and policy["object-src"] == ["'none'"]
    assert policy["frame-ancestors"] == ["'none'"] and policy["base-uri"] == ["'none'"]
    assert not any("unsafe" in v for values in policy.values() for v in values)


async def test_a_streamed_turn_carries_the_policy_too(client, api, sim):
    conv = await api.new()
    await api.patch(conv["id"], settings={"web_search": False, "web_fetch": False})
    sim.enqueue(Script(steps=[steps.Text("hi")]))
    response = await client.post(f"/api/conversations/{conv['id']}/messages", json={"content": "hello"})
    assert parse_sse(response.text)[-1][0] == "done"
    assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY


def test_the_page_has_no_inline_script_style_or_handler_the_policy_would_block():
    for page in STATIC.glob("*.html"):  # the chat page and the usage page (issue 28)
        html = page.read_text(encoding="utf-8")
        scripts = re.findall(r"<script\b([^>]*)>(.*?)</script>", html, re.S | re.I)
        assert scripts and all('src="/static/' in attrs and not body.strip() for attrs, body in scripts), page.name
        assert not re.search(r"<style\b|\sstyle=|\son[a-z]+=|javascript:", html, re.I), page.name
    for module in STATIC.glob("*.js"):
        source = module.read_text(encoding="utf-8")
        assert not re.search(r"\beval\(|new Function\(|setAttribute\(\s*[\"']style|innerHTML\s*=", source), module.name
