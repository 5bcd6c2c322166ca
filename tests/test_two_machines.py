"""The deployment the README recommends for several machines, as an operator runs it (issue 23):
two servers with different DATA_DIRs, one Redis, one S3 (SeaweedFS), AUTH=password. One person's
day crosses both servers; then A comes back with an empty DATA_DIR and has lost nothing.

The parts are proven one by one in test_shared_accounts.py, test_shared_files.py and
test_several_servers.py; this is them together, where a piece still on one disk would show."""

from __future__ import annotations

import itertools
import shutil
import time

import httpx

from chatserver.accounts.auth import SESSION_COOKIE
from gateway_sim.simulator import Script, steps
from s3_support import new_bucket, object_keys
from support import LiveServer, parse_sse
from test_shared_accounts import log_in, redis_url, user_command

PASSWORD = "two machines, one person"
FILE = b"Field notes.\nThe quince orchard flowers in late April, two weeks after the plums.\n"
_names = itertools.count()


def wait_for(check, what: str, within: float = 10.0):
    """`check()` once it is truthy, polled until `within` seconds have passed."""
    deadline = time.monotonic() + within
    while not (found := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return found


async def test_one_person_across_two_machines_and_a_restart_with_an_empty_data_dir(tmp_path, sim, redis_server,
                                                                                    s3_server):
    url, bucket = redis_url(redis_server), new_bucket()
    env = {"GATEWAY_BASE_URL": sim.base_url, "STORE": "redis", "REDIS_URL": url, "AUTH": "password",
           "DEFAULT_TOOL_RUNTIME": "local", "TOOL_ROUNDS_MAX": "1", **s3_server.env(bucket)}

    def machine(name: str) -> LiveServer:
        data_dir = tmp_path / f"{name}-{next(_names)}" / "data"
        data_dir.parent.mkdir(parents=True)
        return LiveServer(data_dir, env)

    added = user_command(url, tmp_path / "operator" / "data", "add", "alice", "--admin", stdin=PASSWORD + "\n")
    assert added.returncode == 0, added.stderr
    assert user_command(url, tmp_path / "operator" / "data", "add", "bob", stdin=PASSWORD + "\n").returncode == 0
    a, b = machine("a"), machine("b")
    try:
        login = log_in(a, "alice", PASSWORD)
        assert login.status_code == 204, login.text
        cookies = {SESSION_COOKIE: login.cookies[SESSION_COOKIE]}
        on_a = httpx.Client(base_url=a.base_url, cookies=cookies, timeout=30)
        on_b = httpx.Client(base_url=b.base_url, cookies=cookies, timeout=30)
        assert on_b.get("/api/auth/me").json()["username"] == "alice"

        # Wrong guesses at bob's password spread over A and B meet one limit.
        for server in (a, b, a, b, a):
            assert log_in(server, "bob", "not bob's password " + str(next(_names))).status_code == 401
        assert log_in(b, "bob", PASSWORD).status_code == 429
        assert log_in(a, "bob", PASSWORD).status_code == 429

        # A preset, the memory and a custom model made on A are used by a turn on B.
        assert on_a.post("/api/presets", json={"name": "Gardener", "text": "You are a patient gardener.",
                                               "tools": ["search_attachments"]}).status_code == 201
        assert on_a.put("/api/memory", json={"text": "Alice grows quinces."}).status_code == 200
        assert on_a.post("/api/models", json={"id": "vendor/orchard-1", "tier": "fast"}).status_code == 201
        conv = on_b.post("/api/conversations", json={"preset": "Gardener", "model": "vendor/orchard-1"})
        assert conv.status_code == 201, conv.text
        conv_id = conv.json()["id"]

        # A file uploaded on A is downloaded on B, and B's turn finds its text with the tool.
        stored = on_a.post(f"/api/conversations/{conv_id}/attachments",
                           files={"file": ("notes.txt", FILE, "text/plain")})
        assert stored.status_code == 201, stored.text
        file_id = stored.json()["id"]
        assert on_b.get(f"/api/conversations/{conv_id}/attachments/{file_id}").content == FILE
        assert await object_keys(s3_server, bucket) == [f"attachments/{conv_id}/{file_id}"]
        sim.enqueue(Script([steps.ToolCall("search_attachments", {"query": "quince orchard flowers"})]),
                    Script([steps.Text("The quinces flower in late April.")]))
        answer = on_b.post(f"/api/conversations/{conv_id}/messages",
                           json={"content": "When do the quinces flower?", "attachment_ids": [file_id]})
        assert parse_sse(answer.text)[-1][0] == "done", answer.text
        sent = sim.requests[-2].body
        system = " ".join(part["text"] for part in sent["messages"][0]["content"])
        assert sent["model"] == "vendor/orchard-1"
        assert "You are a patient gardener." in system and "Alice grows quinces." in system
        tool_result = next(m for m in sim.requests[-1].body["messages"] if m["role"] == "tool")["content"]
        assert "The quince orchard flowers in late April" in tool_result

        # What B wrote, A's search finds within about a second, without a search on its path doing the work.
        written = time.monotonic()
        wait_for(lambda: on_a.get("/api/search", params={"q": "quinces flower"}).json(), "A never found B's reply")
        found_after = time.monotonic() - written
        print(f"A's search found B's reply {found_after:.3f} s after it was saved")
        assert found_after < 2.0

        # A comes back on an empty DATA_DIR (a new machine): nothing is lost.
        a.stop()
        shutil.rmtree(a.data_dir.parent)
        a = machine("a-again")
        on_a = httpx.Client(base_url=a.base_url, cookies=cookies, timeout=30)
        assert on_a.get("/api/auth/me").json()["username"] == "alice"
        assert [c["id"] for c in on_a.get("/api/conversations").json()] == [conv_id]
        assert on_a.get(f"/api/conversations/{conv_id}/attachments/{file_id}").content == FILE
        assert on_a.get("/api/memory").json()["text"] == "Alice grows quinces."
        assert "Gardener" in {p["name"] for p in on_a.get("/api/presets").json()}
        lineup = on_a.get("/api/models").json()
        assert "vendor/orchard-1" in {m["id"] for tier in lineup["tiers"] for m in tier["models"]}
        hits = wait_for(lambda: on_a.get("/api/search", params={"q": "quinces flower"}).json(),
                        "the new A's index never held the conversation")
        assert {h["conversation_id"] for h in hits} == {conv_id}
        assert log_in(a, "alice", PASSWORD).status_code == 204

        # Deleted on B: gone on A and from the bucket.
        assert on_b.delete(f"/api/conversations/{conv_id}").status_code == 204
        assert on_a.get(f"/api/conversations/{conv_id}").status_code == 404
        assert on_a.get(f"/api/conversations/{conv_id}/attachments/{file_id}").status_code == 404
        assert await object_keys(s3_server, bucket) == []

        # Logged out on B: A refuses the cookie.
        assert on_b.post("/api/auth/logout").status_code == 204
        assert on_a.get("/api/auth/me").status_code == 401
        for server in (a, b):
            assert not [p for p in server.data_dir.rglob("*") if p.is_file() and p.suffix in (".json", ".md")], \
                "nothing of the person's is kept on a server's disk"
    finally:
        a.stop()
        b.stop()
