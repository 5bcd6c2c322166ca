"""Search benchmark: the FTS5 index over 1,000 conversations holding 100,000 messages.

The text is generated: words drawn with a Zipf-like skew from a made-up Latin-script vocabulary
and from Korean words, 10-60 words a message, a fifth of the conversations in Korean. It builds
the index from scratch (`rebuild`, as at a first start), then times:

- `search_p50_ms`: `SearchIndex.search` for words people would look for (present in the text, of
  every frequency): Latin words, Korean words of three or more syllables (trigram match) and
  two-syllable Korean words (the bounded scan), each kind also reported on its own;
- `index_update_p50_ms`: a turn's save, `index_messages` with the question and the reply of one
  conversation, from the call until it is committed; and `index_submit_p50_ms`, the part the save
  path itself spends (the write runs in the index's own thread).

It measures the index and SQLite on this machine, not the HTTP route around them.

    .venv/bin/python bench/search_bench.py      # prints JSON; writes bench/results_search.json
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from chatserver.search.index import SearchIndex  # noqa: E402

CONVERSATIONS = 1_000
MESSAGES_EACH = 100
KOREAN_SHARE = 0.2
QUERIES_PER_KIND = 40
UPDATES = 300
SEED = 17
OWNER = "bench"

SYLLABLES = ["ka", "lo", "mi", "ren", "tas", "vel", "dor", "qu", "sen", "ti", "bra", "mon", "zel", "ar", "pi",
             "nox", "ul", "fen", "gri", "hal", "jo", "ker", "lum", "nav", "os", "pra", "ryn", "sto", "vi", "wex"]
HANGUL = [chr(c) for c in range(0xAC00, 0xAC00 + 11172, 37)]  # a spread of Hangul syllables


def vocabulary(rng: random.Random) -> tuple[list[str], list[str]]:
    latin = sorted({"".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4))) for _ in range(12_000)})
    korean = sorted({"".join(rng.choice(HANGUL) for _ in range(rng.randint(2, 4))) for _ in range(6_000)})
    rng.shuffle(latin)
    rng.shuffle(korean)
    return latin, korean


def zipf_weights(n: int) -> list[float]:
    return [1 / (rank + 1) ** 1.05 for rank in range(n)]


def generate(rng: random.Random, latin: list[str], korean: list[str]) -> list[dict]:
    latin_w, korean_w = zipf_weights(len(latin)), zipf_weights(len(korean))
    convs = []
    stamp = 0
    for c in range(CONVERSATIONS):
        words, weights = (korean, korean_w) if rng.random() < KOREAN_SHARE else (latin, latin_w)
        messages = []
        for m in range(MESSAGES_EACH):
            stamp += 1
            text = " ".join(rng.choices(words, weights, k=rng.randint(10, 60)))
            messages.append({"id": f"m{c:04d}-{m:03d}-{rng.getrandbits(32):08x}",
                             "role": "user" if m % 2 == 0 else "assistant", "content": text,
                             "created_at": f"2026-01-01T00:00:{stamp:09d}Z"})
        convs.append({"id": f"c{c:04d}-{rng.getrandbits(48):012x}", "title": " ".join(rng.choices(words, k=3)),
                      "updated_at": messages[-1]["created_at"], "messages": messages, "archive": []})
    return convs


def pick_queries(rng: random.Random, latin: list[str], korean: list[str]) -> dict[str, list[str]]:
    """Words of every frequency that occur: ranks spread over the vocabulary's head and tail."""
    def spread(words: list[str], keep) -> list[str]:
        ranks = sorted(rng.sample(range(min(len(words), 3_000)), QUERIES_PER_KIND * 3))
        return [w for w in (words[r] for r in ranks) if keep(w)][:QUERIES_PER_KIND]
    return {
        "latin": spread(latin, lambda w: len(w) >= 4),
        "korean": spread(korean, lambda w: len(w) >= 3),
        "korean_2char": spread(korean, lambda w: len(w) == 2),
    }


def p50(values: list[float]) -> float:
    return round(statistics.median(values), 3)


async def main() -> dict:
    rng = random.Random(SEED)
    latin, korean = vocabulary(rng)
    convs = generate(rng, latin, korean)
    with tempfile.TemporaryDirectory() as tmp:
        index = SearchIndex(Path(tmp) / "search.sqlite3")
        await index.open()
        started = time.perf_counter()
        await index.rebuild([(OWNER, c) for c in convs])
        build_s = time.perf_counter() - started
        size_mb = sum(f.stat().st_size for f in Path(tmp).iterdir()) / 2**20

        timings: dict[str, list[float]] = {}
        found: dict[str, int] = {}
        for kind, queries in pick_queries(rng, latin, korean).items():
            await index.search(OWNER, queries[0])  # warm the reader's connection and cache
            for q in queries:
                t = time.perf_counter()
                results = await index.search(OWNER, q)
                timings.setdefault(kind, []).append((time.perf_counter() - t) * 1000)
                found[kind] = found.get(kind, 0) + bool(results)

        submits, updates = [], []
        for i in range(UPDATES):
            conv = rng.choice(convs)
            words = latin if rng.random() > KOREAN_SHARE else korean
            turn = [{"id": f"new-{i}-{r}", "role": role, "content": " ".join(rng.choices(words, k=rng.randint(10, 60))),
                     "created_at": f"2026-02-01T00:00:{i:09d}Z"} for r, role in enumerate(("user", "assistant"))]
            t = time.perf_counter()
            written = index.index_messages(OWNER, conv["id"], conv["title"], turn)
            submitted = time.perf_counter()
            await written
            done = time.perf_counter()
            submits.append((submitted - t) * 1000)
            updates.append((done - t) * 1000)
        await index.close()

    every = [ms for values in timings.values() for ms in values]
    return {
        "conversations": CONVERSATIONS, "messages": CONVERSATIONS * MESSAGES_EACH,
        "build_s": round(build_s, 1), "index_mb": round(size_mb, 1),
        "search_p50_ms": p50(every), "search_p95_ms": round(statistics.quantiles(every, n=20)[18], 3),
        **{f"search_{kind}_p50_ms": p50(values) for kind, values in timings.items()},
        "queries_with_hits": f"{sum(found.values())}/{len(every)}",
        "index_update_p50_ms": p50(updates), "index_update_p95_ms": round(statistics.quantiles(updates, n=20)[18], 3),
        "index_submit_p50_ms": p50(submits),
    }


if __name__ == "__main__":
    result = asyncio.run(main())
    print(json.dumps(result, indent=2))
    (ROOT / "bench" / "results_search.json").write_text(json.dumps(result, indent=2) + "\n")
