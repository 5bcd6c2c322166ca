"""A conversation's title from the summarizer model: the request it is sent, and its answer read back.

It knows the wording of the request and what a usable title looks like; the call itself, its cost
and when it is made belong to the turn pipeline (`Turns.name`).
"""

from __future__ import annotations

# The simulator's demo recognises a title request by this opening (simulator.TITLE_REQUEST).
OPENING = "Title this conversation"
REQUEST = (OPENING + " in at most six words, in the language it is written in. Answer with the title only: "
           "no quotes, no trailing period.\n\n{transcript}")
# Enough for a short title; a reasoning summarizer that spends it all on thinking leaves the old title.
MAX_TOKENS = 64
EXCERPT_CHARS = 2000
LIMIT = 60


def request(question: str, reply: str) -> str:
    """The one user message sent to the summarizer: the first exchange, each side cut to an excerpt."""
    transcript = f"user: {question.strip()[:EXCERPT_CHARS]}\nassistant: {reply.strip()[:EXCERPT_CHARS]}"
    return REQUEST.replace("{transcript}", transcript)


def parse(text: object, finish: str) -> str | None:
    """The title in the summarizer's answer, or None when it gave none usable (cut off, empty, a refusal)."""
    if not isinstance(text, str) or finish in ("length", "max_tokens", "content_filter"):
        return None
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if line.lower().startswith("title:"):
        line = line[6:].strip()
    line = line.strip("#*_`\"'“”‘’«» ").rstrip(".").strip()
    if not line:
        return None
    if len(line) > LIMIT:
        cut = line[:LIMIT].rsplit(" ", 1)[0]
        line = (cut if len(cut) > LIMIT // 2 else line[:LIMIT]).rstrip() + "…"
    return line
