"""Projects: a person's folders of conversations, each with its own instructions and files.

A project is kept in the person's `projects` document (the store's OwnerStore documents, like the
presets): `{"version": 1, "projects": [{"id", "name", "instructions", "created_at", "updated_at"}]}`.
A conversation belongs to one when its `project_id` names it. The instructions join the cached
part of every prompt of its conversations (`context.build_prompt`); its files are attachments in
the scope `project/<id>`, which only a project this person's document holds ever reaches: `get`
is the owner check for everything a project carries.

It knows documents and ids, not HTTP, turns or attachments' contents.
"""

from __future__ import annotations

import orjson

from chatserver.conversations.document import new_id, now_iso, valid_id
from chatserver.store.files import OwnerStore

DOCUMENT = "projects"
VERSION = 1
MAX_PROJECTS = 500


class ProjectNotFound(LookupError):
    """No project with that id among this person's (another person's id included)."""


class TooManyProjects(ValueError):
    pass


def _parse(raw: bytes | None) -> list[dict]:
    if raw is None:
        return []
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return []
    found = data.get("projects") if isinstance(data, dict) else None
    return [p for p in found or [] if isinstance(p, dict) and isinstance(p.get("id"), str)]


def _dump(projects: list[dict]) -> bytes:
    return orjson.dumps({"version": VERSION, "projects": projects}, option=orjson.OPT_INDENT_2)


class Projects:
    """One person's projects, read from and written to their store."""

    def __init__(self, store: OwnerStore) -> None:
        self.store = store

    async def list(self) -> list[dict]:
        return sorted(_parse(await self.store.read_document(DOCUMENT)), key=lambda p: p["name"].casefold())

    async def get(self, project_id: str) -> dict:
        """The person's project; ProjectNotFound for an unknown id or another person's."""
        if isinstance(project_id, str) and valid_id(project_id):
            for project in _parse(await self.store.read_document(DOCUMENT)):
                if project["id"] == project_id:
                    return project
        raise ProjectNotFound(project_id)

    async def create(self, name: str, instructions: str = "") -> dict:
        now = now_iso()
        project = {"id": new_id(), "name": name, "instructions": instructions, "created_at": now, "updated_at": now}

        def add(raw: bytes | None) -> bytes:
            projects = _parse(raw)
            if len(projects) >= MAX_PROJECTS:
                raise TooManyProjects(f"a person may have at most {MAX_PROJECTS} projects")
            return _dump([*projects, project])

        await self.store.update_document(DOCUMENT, add)
        return project

    async def update(self, project_id: str, changes: dict) -> dict:
        """Apply `changes` (`name`, `instructions`) to the project; the updated project."""
        await self.get(project_id)
        changed: dict = {}

        def edit(raw: bytes | None) -> bytes:
            projects = _parse(raw)
            for project in projects:
                if project["id"] == project_id:
                    project.update(changes, updated_at=now_iso())
                    changed.update(project)
                    return _dump(projects)
            raise ProjectNotFound(project_id)  # removed meanwhile: nothing is stored

        await self.store.update_document(DOCUMENT, edit)
        return changed

    async def remove(self, project_id: str) -> dict:
        """Take the project out of the person's document; the project it was."""
        project = await self.get(project_id)

        def drop(raw: bytes | None) -> bytes:
            return _dump([p for p in _parse(raw) if p["id"] != project_id])

        await self.store.update_document(DOCUMENT, drop)
        return project

    async def instructions_for(self, conv: dict) -> tuple[str | None, str]:
        """The conversation's project id and instructions, or (None, "") when it has none that
        still exists (a project deleted by another process meanwhile)."""
        project_id = conv.get("project_id")
        if not project_id:
            return None, ""
        try:
            project = await self.get(project_id)
        except ProjectNotFound:
            return None, ""
        return project["id"], project.get("instructions", "")
