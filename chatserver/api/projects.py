"""Routes for projects: a person's folders of conversations, with their own instructions and files.

Every route passes the one owner check twice over: the store view (`deps.OwnerStoreDep`) is the
person's, and a project is reached only through `Projects.get`, which reads that person's own
projects document, so another person's project id is 404 like an unknown one. Its files are
attachments in the scope `project/<id>`, reached only after that check.

Deleting a project keeps its conversations (they move out of it, to the top level) and deletes
its files.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import FileResponse, Response

from chatserver.api.attachments import (
    ERRORS,
    PAGE_ERRORS,
    UPLOAD_BODY,
    AttachmentsDep,
    Label,
    PageNumber,
    PassagesOut,
    Words,
)
from chatserver.api.attachments import _delete as delete_file
from chatserver.api.attachments import _download as download_file
from chatserver.api.attachments import _page_image as page_image
from chatserver.api.attachments import _passages as file_passages
from chatserver.api.attachments import _upload as upload_file
from chatserver.api.deps import OwnerDep, OwnerStoreDep, State, StateDep
from chatserver.api.schemas import Project, ProjectCreate, ProjectPatch
from chatserver.attachments.store import Scope, project_scope, public
from chatserver.conversations.projects import ProjectNotFound, Projects, TooManyProjects
from chatserver.store.files import NotFound

router = APIRouter(prefix="/api/projects", tags=["projects"])
NOT_FOUND = {404: {"description": "no such project (another person's included)"}}


async def get_projects(store: OwnerStoreDep) -> Projects:
    return Projects(store)


def announce(state: State, owner: str, project_id: str) -> None:
    """Tell the person's other pages (tabs, devices, servers) that a project changed: they read the list again."""
    state.events.publish(owner, "project", {"id": project_id})


ProjectsDep = Annotated[Projects, Depends(get_projects)]


async def project_files(project_id: str, projects: ProjectsDep) -> Scope:
    """The project's file scope, once the project is found among this person's (404 otherwise)."""
    return project_scope((await projects.get(project_id))["id"])


FilesDep = Annotated[Scope, Depends(project_files)]


@router.get("")
async def list_projects(projects: ProjectsDep) -> list[Project]:
    return await projects.list()  # type: ignore[return-value]


@router.post("", status_code=201)
async def create_project(body: ProjectCreate, projects: ProjectsDep, state: StateDep) -> Project:
    try:
        made = await projects.create(body.name, body.instructions)
    except TooManyProjects as exc:
        raise HTTPException(413, str(exc)) from None
    announce(state, projects.store.owner, made["id"])
    return made  # type: ignore[return-value]


@router.get("/{project_id}", responses=NOT_FOUND)
async def get_project(project_id: str, projects: ProjectsDep) -> Project:
    return await projects.get(project_id)  # type: ignore[return-value]


@router.patch("/{project_id}", responses=NOT_FOUND)
async def patch_project(project_id: str, body: ProjectPatch, projects: ProjectsDep, state: StateDep) -> Project:
    changed = await projects.update(project_id, body.model_dump(exclude_none=True))
    announce(state, projects.store.owner, project_id)
    return changed  # type: ignore[return-value]


@router.delete("/{project_id}", status_code=204, responses=NOT_FOUND)
async def delete_project(project_id: str, projects: ProjectsDep, store: OwnerStoreDep, state: StateDep) -> Response:
    """The conversations stay, moved out of the project; its files are deleted."""
    await projects.remove(project_id)
    for entry in await store.list():
        if entry.get("project_id") == project_id:
            try:
                await store.update(entry["id"], _move_out(project_id))
            except NotFound:
                continue  # deleted meanwhile
    await state.attachments.delete_scope(project_scope(project_id))
    announce(state, store.owner, project_id)
    return Response(status_code=204)


def _move_out(project_id: str):
    def change(conv: dict) -> None:
        if conv.get("project_id") == project_id:
            conv["project_id"] = None
    return change


@router.post("/{project_id}/files", status_code=201, openapi_extra=UPLOAD_BODY, responses=ERRORS)
async def upload_project_file(scope: FilesDep, request: Request, attachments: AttachmentsDep,
                              store: OwnerStoreDep) -> dict:
    """Add a file to the project (multipart field `file`): 201 with the Attachment."""
    stored = await upload_file(request, attachments, scope, store)
    try:
        await Projects(store).get(scope.key.removeprefix("project/"))
    except ProjectNotFound:
        await attachments.delete_scope(scope)  # the project was deleted during the upload
        raise
    return stored


@router.get("/{project_id}/files", responses=NOT_FOUND)
async def list_project_files(scope: FilesDep, attachments: AttachmentsDep) -> list[dict]:
    return [public(m) for m in await attachments.list(scope)]


@router.get("/{project_id}/files/{attachment_id}", responses=ERRORS, response_class=FileResponse)
async def download_project_file(scope: FilesDep, attachment_id: str, attachments: AttachmentsDep) -> Response:
    return await download_file(attachments, scope, attachment_id)


@router.get("/{project_id}/files/{attachment_id}/passages", responses=ERRORS)
async def project_file_passages(scope: FilesDep, attachment_id: str, attachments: AttachmentsDep,
                                label: Label = None, page: PageNumber = None, q: Words = None) -> PassagesOut:
    return await file_passages(attachments, scope, attachment_id, label, page, q)


@router.get("/{project_id}/files/{attachment_id}/pages/{page}.png", responses=PAGE_ERRORS, response_class=FileResponse)
async def project_file_page(scope: FilesDep, attachment_id: str, page: str, request: Request,
                            attachments: AttachmentsDep, owner: OwnerDep) -> Response:
    return await page_image(request, attachments, scope, attachment_id, page, owner)


@router.delete("/{project_id}/files/{attachment_id}", status_code=204, responses=ERRORS)
async def delete_project_file(scope: FilesDep, attachment_id: str, attachments: AttachmentsDep) -> Response:
    return await delete_file(attachments, scope, attachment_id)
