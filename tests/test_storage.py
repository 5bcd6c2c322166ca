"""The store: atomic writes that survive a killed process, damaged files left alone, safe ids."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from storage import Damaged, NotFound, Store, new_id, valid_id

ROOT = Path(__file__).resolve().parent.parent

WRITER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[2])
    from storage import Store
    store = Store(sys.argv[1])
    conv_id = sys.argv[3]
    padding = "x" * 20000
    while True:
        store.update(conv_id, lambda c: c["messages"].append(
            {"id": str(len(c["messages"])), "role": "user", "content": padding}))
        print(len(store.get(conv_id)["messages"]), flush=True)
""")


def test_a_process_killed_mid_write_never_leaves_torn_json(tmp_path):
    store = Store(tmp_path)
    conv_id = new_id()
    store.create({"id": conv_id, "model": "m", "settings": {}})
    path = store.conversations_dir / f"{conv_id}.json"
    committed = 0
    for round_ in range(8):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(ROOT), conv_id],
                                  stdout=subprocess.PIPE, text=True)
        # Read a few acknowledged writes, then kill at an arbitrary point of the next one.
        for _ in range(3 + round_):
            committed = max(committed, int(writer.stdout.readline()))
        time.sleep(0.001 * round_)
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
        writer.stdout.close()
        data = json.loads(path.read_text())  # must parse: old or new version, never a mix
        assert len(data["messages"]) >= committed
    assert not [p for p in store.conversations_dir.iterdir() if p.suffix == ".json" and p != path]


def test_damaged_file_is_reported_skipped_and_never_overwritten(tmp_path, caplog):
    store = Store(tmp_path)
    good = store.create({"id": new_id(), "model": "m", "settings": {}})
    bad_id = new_id()
    bad_path = store.conversations_dir / f"{bad_id}.json"
    bad_path.write_text('{"id": "' + bad_id + '", "messages": [')

    assert [c["id"] for c in store.list()] == [good["id"]]
    assert bad_path.name in caplog.text
    with pytest.raises(Damaged):
        store.get(bad_id)
    with pytest.raises(Damaged):
        store.update(bad_id, lambda c: c.update(title="x"))
    assert bad_path.read_text() == '{"id": "' + bad_id + '", "messages": ['


def test_ids_are_random_and_path_shaped_ids_never_touch_the_disk(tmp_path):
    ids = {new_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(valid_id(i) for i in ids)
    store = Store(tmp_path)
    for hostile in ["../../etc/passwd", "..", "a/b", "x.json", "", "con:1", "\x00abcdefgh"]:
        with pytest.raises(NotFound):
            store.get(hostile)


def test_older_files_are_upgraded_on_read(tmp_path):
    store = Store(tmp_path)
    conv_id = new_id()
    (store.conversations_dir / f"{conv_id}.json").write_text(json.dumps(
        {"id": conv_id, "model": "m", "messages": [{"id": "1", "role": "user", "content": "hi"}]}))

    conv = store.get(conv_id)

    assert conv["schema_version"] == 1 and conv["summary"] == "" and conv["totals"]["turns"] == 0
    assert conv["messages"][0]["content"] == "hi"
