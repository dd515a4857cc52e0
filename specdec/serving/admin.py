"""The operator's routes, `/admin/*`: `GET /admin/draft` names the draft head drafting, `POST /admin/draft` swaps it
between two engine steps. They load files on the server's machine, so they have a key of their own:

    no --admin-key          every /admin/* route answers 404, naming --admin-key
    --admin-key KEY         no key, or a wrong one: 401; the API key (--api-key) alone: 403; KEY: the route
                            (the API key check skips /admin/*, so KEY alone opens them)

A head loaded through them comes only from the folders in `--allowed-head-dirs` or from the Hugging Face cache: the
path given, and every file in the head's folder, are resolved (links, `..`) before they are checked, and one outside
is a 403 naming where it leads. A Hub id (`org/name`) loads through the cache, as `--speculative-config` does.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict

from specdec.config import SpecdecError
from specdec.models.hub import cache_dir, is_hub_id
from specdec.serving.api import ADMIN_PATH, APIError, ErrorBody, error_responses, presented_key, same_key


@dataclass
class Admin:
    """`specdec serve --admin-key KEY --allowed-head-dirs DIR...`; key None: the admin routes are off."""

    key: str | None = None
    head_dirs: list[str | Path] = field(default_factory=list)  # besides the Hugging Face cache

    def __post_init__(self) -> None:
        if self.key is not None and not self.key.strip():
            raise SpecdecError("--admin-key is empty: give a key, or leave the flag out to keep /admin/* off")
        for folder in self.head_dirs:
            if not Path(folder).expanduser().is_dir():
                raise SpecdecError(f"--allowed-head-dirs {folder}: no such directory")

    def roots(self) -> list[Path]:
        """The folders heads may come from, resolved."""
        return [Path(d).expanduser().resolve() for d in self.head_dirs] + [cache_dir().resolve()]


class DraftBody(BaseModel):
    """`POST /admin/draft`: the head to draft with from the next engine step on."""
    model_config = ConfigDict(extra="forbid")
    model: str  # the head's directory (config.json + weights) or weight file on the server's machine, or a Hub id


class DraftHead(BaseModel):
    object: Literal["draft_head"]
    method: str | None  # the speculative method (None: the server does not speculate)
    model: str | None  # the directory of the head it drafts with (None: a method without a head)


def head_path(name: str, roots: list[Path]) -> str:
    """What the loader is given for the head `name`: a Hub id as it is, a path resolved, once it and the files of
    its folder lie under `roots` (APIError 403 naming the first that does not)."""
    if is_hub_id(name):
        return name
    try:
        path = Path(name).expanduser().resolve()
    except (RuntimeError, ValueError, OSError) as e:  # an unknown ~user, a NUL byte, a loop of links
        raise APIError(400, f"draft head {name!r} is not a path: {e}", param="model", code="invalid_draft_head") \
            from None
    folder = path if path.is_dir() else path.parent if path.is_file() else None  # what the loader reads
    for given, real in [(name, path), *((str(f), f.resolve()) for f in _entries(folder) if f != path)]:
        if not any(real.is_relative_to(root) for root in roots):
            raise APIError(403, f"draft head {given!r} is {real}, outside the folders heads may be loaded from "
                           f"({', '.join(map(str, roots))}); add its folder to --allowed-head-dirs",
                           param="model", code="head_not_allowed")
    return str(path)


def _entries(folder: Path | None) -> list[Path]:
    if folder is None:
        return []
    try:
        return sorted(folder.iterdir())
    except OSError:  # not there (the loader says so) or not readable
        return []


class AdminEndpoint:
    """The /admin routes over the server's draft card and head reload, behind the admin key."""

    def __init__(self, admin: Admin, api_key: str | None, draft_head: Callable[[], dict],
                 reload_draft: Callable[[str], Awaitable[dict]]) -> None:
        if admin.key is not None and api_key is not None and same_key(admin.key, api_key):
            raise SpecdecError("--admin-key must differ from --api-key: the API key goes to every client")
        self.admin, self.api_key = admin, api_key
        self.draft_head, self.reload_draft = draft_head, reload_draft
        self.roots = admin.roots()

    def router(self) -> APIRouter:
        if self.admin.key is None:
            router = APIRouter()
            router.add_api_route(ADMIN_PATH + "{path:path}", off, methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
                                 include_in_schema=False)
            return router
        router = APIRouter(prefix=ADMIN_PATH.rstrip("/"), dependencies=[Depends(self.check_key)])
        errors = {code: error_responses()[code] for code in (401, 413, 500, 503)} | {403: {
            "model": ErrorBody, "description": "the API key instead of the admin key, or a head outside the allowed "
            "folders"}}
        router.add_api_route("/draft", self.get_draft, methods=["GET"], response_model=DraftHead,
                             responses={code: errors[code] for code in (401, 403)})
        router.add_api_route("/draft", self.post_draft, methods=["POST"], response_model=DraftHead, responses=errors | {
            400: {"model": ErrorBody, "description": "the head is refused (not found, another method or shape, no "
                  "head method served): the old one keeps drafting"}})
        return router

    def check_key(self, request: Request) -> None:
        given = presented_key(request)
        if given and same_key(given, self.admin.key):
            return
        if given and self.api_key is not None and same_key(given, self.api_key):
            raise APIError(403, "the API key does not open /admin/*: send the admin key (--admin-key) as "
                           "'Authorization: Bearer <admin key>'", code="admin_key_required")
        raise APIError(401, "invalid or missing admin key: /admin/* needs 'Authorization: Bearer <admin key>' (the "
                       "key given to --admin-key)", code="invalid_admin_key")

    async def get_draft(self) -> dict:
        return self.draft_head()

    async def post_draft(self, body: DraftBody) -> dict:
        return await self.reload_draft(head_path(body.model, self.roots))


async def off(path: str) -> None:
    raise APIError(404, f"/admin/{path} is off: the admin routes need `specdec serve --admin-key KEY` (a key of "
                   "their own, not --api-key)", code="admin_off")
