"""Removing a person's data from the stores: the one way both `server.py user remove` and the
People routes do it (each then ends the account first, and tidies what lies beside it).

It knows the stores and the attachments, not HTTP, terminals or the search indexes' files.
"""

from __future__ import annotations

from chatserver.attachments.store import Attachments, conversation_scope, library_scope, project_scope
from chatserver.conversations.projects import Projects
from chatserver.conversations.sharing import Shares
from chatserver.store.files import Store
from chatserver.turns import context


async def remove_person_data(store: Store, attachments: Attachments, owner: str) -> list[str]:
    """Delete everything `owner` keeps in the store and the attachments (metadata, originals, the
    passage index's rows): conversations with their files, projects with theirs, shared links,
    library, memory and presets. The ids of the conversations deleted."""
    mine = store.for_owner(owner)
    conv_ids = [c["id"] for c in await mine.list()]
    for conv_id in conv_ids:
        await mine.delete(conv_id)
        context.forget(conv_id)  # nor do their words stay in this process's memory
        await attachments.delete_scope(conversation_scope(conv_id))
    for project in await Projects(mine).list():
        await attachments.delete_scope(project_scope(project["id"]))
    await attachments.delete_scope(library_scope(owner))
    await Shares(store, mine).forget_all()
    await mine.forget_document("projects")
    await mine.forget_memory()
    await mine.forget_presets()
    return conv_ids
