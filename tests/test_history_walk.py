"""Issue 30: a turn walks only the history that changed since the conversation's last turn.

The wire form of the messages a turn walked is kept (bounded) for the next one; these tests check
that what is sent is exactly the whole walk's, that only new messages are walked, that an edit,
a rewind or a deletion starts over, and that the cache stays within its bound.
"""

from __future__ import annotations

import orjson
import pytest

from chatserver.config import Settings
from chatserver.conversations.document import new_id
from chatserver.turns import context
from chatserver.upstream.body import body_pieces


def message(role: str, text: str, **extra) -> dict:
    return {"id": new_id(), "role": role, "content": text, "created_at": "2026-12-04T00:00:00Z", **extra}


def conversation(n: int) -> dict:
    messages = [message("user" if i % 2 == 0 else "assistant", f"message {i} " + "word " * (i % 7)) for i in range(n)]
    messages.insert(3, message("notice", "Folded 0 earlier messages."))
    rounds = [{"text": "looking ", "calls": [{"id": "c1", "name": "calc", "arguments": "{\"x\": 1}"}],
               "results": [{"call_id": "c1", "name": "calc", "content": "2", "is_error": False}]}]
    messages.insert(5, message("assistant", "looking it is 2", rounds=rounds))
    return {"id": new_id(), "settings": {"system_prompt": "Be brief."}, "summary": "", "messages": messages}


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(_env_file=None, data_dir=tmp_path / "data")


@pytest.fixture
def walks(monkeypatch) -> list[int]:
    """How many messages each wire_history call walked."""
    seen: list[int] = []
    whole = context.wire_history

    def counting(messages, **kw):
        seen.append(len(messages))
        return whole(messages, **kw)

    monkeypatch.setattr(context, "wire_history", counting)
    return seen


def expected(conv: dict, settings: Settings) -> tuple[list[dict], int]:
    """The prompt's messages and count as a walk of the whole history makes them."""
    alone = {**conv, "id": new_id()}  # a walk of its own, leaving the conversation's kept walk alone
    prompt = context.build_prompt(alone, "", settings, today=context.dt.date(2026, 12, 4))
    context.forget(alone["id"])
    return prompt.messages, context.Prompt(prompt.system, prompt.messages).tokens()


def test_a_turn_walks_only_what_came_since_and_sends_what_a_whole_walk_sends(settings, walks):
    conv = conversation(400)
    first = context.build_prompt(conv, "", settings, today=context.dt.date(2026, 12, 4))
    assert sum(walks) == len(conv["messages"])
    for turn in range(3):
        conv["messages"] += [message("assistant", f"reply {turn}"), message("user", f"question {turn}")]
        walks.clear()
        prompt = context.build_prompt(conv, "", settings, today=context.dt.date(2026, 12, 4))
        assert sum(walks) == 3  # the last kept message's successor, the reply, the new question
        count = prompt.tokens()
        walks.clear()
        assert (prompt.messages, count) == expected(conv, settings)
    assert first.tokens() < count


def test_an_edit_or_a_rewind_starts_the_walk_over(settings, walks):
    conv = conversation(50)
    context.build_prompt(conv, "", settings, today=context.dt.date(2026, 12, 4))
    # An edit inside what was walked (the second message, in copies of the rest) walks it all again.
    conv["messages"] = [dict(m) for m in conv["messages"][:20]] + [message("user", "again")]
    conv["messages"][1] = {**conv["messages"][1], "content": "changed"}
    walks.clear()
    prompt = context.build_prompt(conv, "", settings, today=context.dt.date(2026, 12, 4))
    assert sum(walks) == len(conv["messages"])
    assert {"role": "assistant", "content": "changed"} in prompt.messages
    # A rewind keeps a prefix of the very dicts: also walked again, the cut is not mistaken for history.
    conv["messages"] = conv["messages"][:5]
    walks.clear()
    prompt = context.build_prompt(conv, "", settings, today=context.dt.date(2026, 12, 4))
    assert prompt.messages == expected(conv, settings)[0]


def test_the_body_sends_the_walked_runs_as_they_are_and_reads_as_the_whole_walk(settings, monkeypatch):
    monkeypatch.setattr(context, "RUN_BYTES", 2048)  # several runs, as a long history makes
    conv = conversation(300)
    context.build_prompt(conv, "", settings, today=context.dt.date(2026, 12, 4))
    for turn in range(40):  # each turn extends the last run until it is full, then starts another
        conv["messages"] += [message("assistant", f"reply {turn} " + "word " * 30), message("user", f"question {turn}")]
        prompt = context.build_prompt(conv, "", settings, today=context.dt.date(2026, 12, 4))
        runs = prompt.walked.runs
        assert all(len(run.data) < 2 * 2048 for run in runs[:-1])
        pieces = body_pieces({"model": "m", "messages": [{"role": "system", "content": "s"}, *prompt.encodable()],
                              "stream": True})
        # Each run is a piece of its own, the very bytes kept with the walk: sent, not copied.
        assert [piece for piece in pieces if any(piece is run.data for run in runs)] == [run.data for run in runs]
        body = orjson.loads(b"".join(pieces))
        assert body["messages"][1:] == expected(conv, settings)[0]
        assert (body["model"], body["stream"]) == ("m", True)
    assert len(runs) > 10


def test_a_body_without_runs_is_one_piece_and_an_unknown_object_is_refused():
    assert body_pieces({"messages": [{"role": "user", "content": "a\x00b"}]}) == [
        orjson.dumps({"messages": [{"role": "user", "content": "a\x00b"}]})]
    with pytest.raises(TypeError):
        body_pieces({"messages": [object()]})


def test_the_kept_walks_stay_within_their_bound_and_go_with_their_conversation(settings, monkeypatch):
    monkeypatch.setattr(context, "WALKED_BYTES", 200_000)
    convs = [conversation(300) for _ in range(6)]
    for conv in convs:
        context.build_prompt(conv, "", settings, today=context.dt.date(2026, 12, 4))
        assert 0 < context._walked_size <= 200_000
        assert context._walked_size == sum(w.size for w in context._walked.values())
    assert convs[-1]["id"] in context._walked and convs[0]["id"] not in context._walked
    context.forget(convs[-1]["id"])
    assert convs[-1]["id"] not in context._walked
    for conv in convs:
        context.forget(conv["id"])
    assert context._walked_size == 0


def test_the_list_entry_of_a_long_conversation_counts_right_however_its_messages_change():
    from chatserver.conversations import document

    def count(messages: list[dict]) -> int:
        return sum(m["role"] != "notice" for m in messages)

    conv = {**conversation(1500), "title": "t", "model": "m", "updated_at": "u", "created_at": "c"}
    messages = conv["messages"]
    assert document.summary_of(conv)["message_count"] == count(messages)
    steps = [
        lambda: messages.append(message("assistant", "a reply")),           # a turn's reply
        lambda: messages.append(message("notice", "Folded 3 messages.")),    # a notice at the end
        lambda: messages.__setitem__(-1, message("user", "replaced in place")),  # a checkpoint's replacement
        lambda: messages.__setitem__(700, message("notice", "edited in the middle")),  # a change inside the prefix
        lambda: messages.__delitem__(slice(1000, None)),                    # a rewind
        lambda: messages.extend(message("user", f"more {i}") for i in range(600)),
    ]
    for step in steps:
        step()
        assert document.summary_of(conv)["message_count"] == count(messages)
    assert conv["id"] in document._counted
    context.forget(conv["id"])  # deleted: nothing of its messages stays
    assert conv["id"] not in document._counted
