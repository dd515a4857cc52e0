"""The responses the server keeps for the Responses API (`store`, default true as at OpenAI): what
`previous_response_id` continues and `GET /v1/responses/{id}` returns. Bounded, least recently used dropped first;
`--max-stored-responses 0` keeps none. Kept in memory while the server runs, per server (a replica its own).
"""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

from specdec.serving.api import APIError


@dataclass
class Stored:
    response: dict  # the Response as it was answered
    conversation: list[dict]  # the chat messages a request continuing it starts from
    size: int  # its bytes, roughly (JSON text), counted against the store's budget


class ResponseStore:
    """Responses kept for `previous_response_id` and GET, least recently used dropped first past `max_entries` or
    `max_bytes` (0 entries: nothing is stored)."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.entries: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def put(self, response: dict, conversation: list[dict]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        if not self.enabled or size > self.max_bytes:
            return
        self.entries[response["id"]] = Stored(response, conversation, size)
        self.bytes += size
        while len(self.entries) > self.max_entries or self.bytes > self.max_bytes:
            self.bytes -= self.entries.popitem(last=False)[1].size

    def get(self, rid: str, param: str | None = None) -> Stored:
        """The stored response (now the most recently used); 404 naming `param` when it is not stored."""
        if rid not in self.entries:
            raise APIError(404, f"response with id {rid!r} not found (responses are kept while the server runs, "
                           f"the latest {self.max_entries} at most)", param=param, code="response_not_found")
        self.entries.move_to_end(rid)
        return self.entries[rid]

    def delete(self, rid: str) -> dict:
        stored = self.get(rid)
        del self.entries[rid]
        self.bytes -= stored.size
        return {"id": rid, "object": "response", "deleted": True}
