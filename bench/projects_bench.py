"""What projects and shared copies cost (issue 27), in CPU time, alternating the compared cases
so the shared, noisy machine weighs on both alike:

- `projects_lookup_us`: a turn's extra work for its project, reading the person's projects
  document and finding the conversation's (`Projects.instructions_for`), on the file store;
  beside `no_project_lookup_us`, the same call for a conversation in no project.
- `prompt_with_project_us` / `prompt_without_project_us`: `context.build_prompt` for a
  200-message conversation with and without 2,000 characters of project instructions.
- `share_create_ms`: snapshotting a 1,000-message conversation at a new link (file store, fsynced).
- `shared_page_ms`: rendering that snapshot as the shared page (escaped HTML).

Writes bench/results_projects.json. Run: `.venv/bin/python bench/projects_bench.py`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from chatserver.api.sharing import render_messages, render_page  # noqa: E402
from chatserver.config import Settings  # noqa: E402
from chatserver.conversations.document import new_id, now_iso  # noqa: E402
from chatserver.conversations.projects import Projects  # noqa: E402
from chatserver.conversations.sharing import Shares, read_snapshot  # noqa: E402
from chatserver.store.files import FileStore  # noqa: E402
from chatserver.turns import context  # noqa: E402

ROUNDS = 200


def conversation(messages: int, project_id: str | None) -> dict:
    out, parent = [], None
    for i in range(messages):
        role = "user" if i % 2 == 0 else "assistant"
        m = {"id": new_id(), "role": role, "content": f"message {i} " + "words of a chat reply " * 20,
             "created_at": now_iso(), "parent_id": parent}
        if role == "assistant":
            m.update(model="m", status="complete", usage={"input_tokens": 1000 + i, "output_tokens": 80, "cost": 0.001})
        out.append(m)
        parent = m["id"]
    return {"id": new_id(), "title": "Bench", "model": "m", "created_at": now_iso(), "updated_at": now_iso(),
            "settings": {"system_prompt": "You are helpful."}, "messages": out, "project_id": project_id}


def cpu_us(call) -> float:
    start = time.process_time()
    call()
    return (time.process_time() - start) * 1e6


async def main() -> dict:
    context.load_tokenizer()
    settings = Settings(_env_file=None)
    with tempfile.TemporaryDirectory() as tmp:
        store = FileStore(Path(tmp))
        mine = store.for_owner("bench")
        projects = Projects(mine)
        for n in range(20):
            await projects.create(f"project {n}", "instructions " * 150)
        chosen = (await projects.list())[7]
        inside, outside = conversation(200, chosen["id"]), conversation(200, None)
        lookups: dict[str, list[float]] = {"with": [], "without": []}
        prompts: dict[str, list[float]] = {"with": [], "without": []}
        today = dt.date.today()
        for _ in range(ROUNDS):  # alternating: each round measures both cases
            for case, conv in (("with", inside), ("without", outside)):
                start = time.process_time()
                _, text = await projects.instructions_for(conv)
                lookups[case].append((time.process_time() - start) * 1e6)
                prompts[case].append(cpu_us(lambda: context.build_prompt(conv, "", settings, today=today,
                                                                         project=text)))
        long = await mine.create(conversation(1000, None))
        shares = Shares(store, mine)
        made = []
        for _ in range(10):
            start = time.perf_counter()
            entry = await shares.create(long, costs=True)
            made.append((time.perf_counter() - start) * 1000)
        snapshot = await read_snapshot(store, entry["id"])
        pages = [cpu_us(lambda: render_page(snapshot["title"], render_messages(snapshot))) / 1000 for _ in range(20)]
        await store.flush()
    med = statistics.median
    return {
        "projects_lookup_us": round(med(lookups["with"]), 1),
        "no_project_lookup_us": round(med(lookups["without"]), 1),
        "prompt_with_project_us": round(med(prompts["with"]), 1),
        "prompt_without_project_us": round(med(prompts["without"]), 1),
        "share_create_ms": round(med(made), 2),
        "shared_page_ms": round(med(pages), 2),
        "shared_page_messages": len(snapshot["messages"]),
    }


if __name__ == "__main__":
    results = asyncio.run(main())
    (ROOT / "bench" / "results_projects.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
