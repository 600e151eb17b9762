"""``/v1/loras``: list, load and unload the served model's LoRA adapters (behind the API key,
like every ``/v1`` route).

- ``GET /v1/loras``: every adapter the engine knows (`DiffusionEngine.list_loras`).
- ``POST /v1/loras`` ``{"name", "path"}``: load the file or folder at ``path``, which must lie
  inside the server's ``--lora-dir`` (a relative path is taken from it; anything else is a 400
  naming ``path``); answers once every worker holds it. Reading a file does not stall the running
  requests' steps.
- ``DELETE /v1/loras/{name}``: unload; 409 while waiting or running requests use it.

The served model's built-in adapters (origin ``builtin``, e.g. ``mirror`` of ``digits``) cannot
be unloaded or re-pointed over HTTP (409 ``lora_builtin`` naming ``name``): no ``POST`` could
bring them back, their files lying outside ``--lora-dir``. The offline
`DiffusionEngine.unload_lora` / ``load_lora`` still may (the operator's choice).
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from diffserve.core.errors import InvalidRequestError, LoraInUseError
from diffserve.entrypoints.openai.errors import APIError, invalid_request
from diffserve.entrypoints.openai.protocol import ErrorResponse
from diffserve.entrypoints.openai.request_body import read_json


class LoraLoadRequest(BaseModel):
    """Body of ``POST /v1/loras``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=128, description="the name requests use in loras")
    path: str = Field(min_length=1, max_length=4096, description="a .safetensors file or a LoRA folder inside "
                                                                  "the server's --lora-dir (relative to it)")


class LoraList(BaseModel):
    """Response of ``GET /v1/loras``."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]


class LoraDeleted(BaseModel):
    """Response of ``DELETE /v1/loras/{name}``."""

    name: str
    object: Literal["lora"] = "lora"
    deleted: bool = True


def install_lora_routes(app: FastAPI, state, loading: bool = True) -> None:
    """Add the ``/v1/loras`` routes; `state` is the app's `ServerState`. ``POST /v1/loras`` only
    with `loading` (a server with ``--lora-dir``: without one nothing could load, so the route is
    not served and the schema does not list it)."""
    errors = {code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 503)}
    body_errors = {**errors, **{code: {"model": ErrorResponse} for code in (413, 415)}}

    def engine():
        state.require_service()
        return state.engine

    def refuse_builtin(client, name: str, action: str) -> None:
        """409 ``lora_builtin`` (naming ``name``) if `name` is one of the model's own adapters."""
        if any(e["name"] == name and e["origin"] == "builtin" for e in client.list_loras()):
            raise APIError(409, f"LoRA {name!r} is a built-in adapter of the served model; it cannot be {action} "
                           "over HTTP", param="name", code="lora_builtin")

    @app.get("/v1/loras", response_model=LoraList, responses=errors)
    async def list_loras() -> LoraList:
        """The LoRA adapters requests may name (``--lora-dir`` files appear once named)."""
        return LoraList(data=engine().list_loras())

    if loading:
        @app.post("/v1/loras", responses=body_errors, openapi_extra={"requestBody": {"required": True, "content": {
            "application/json": {"schema": LoraLoadRequest.model_json_schema()}}}})
        async def load_lora(raw_request: Request) -> dict[str, Any]:
            """Load a LoRA adapter from inside ``--lora-dir``; its listing entry."""
            body = await read_json(raw_request, LoraLoadRequest)
            client = engine()
            refuse_builtin(client, body.name, "replaced (load yours under another name)")
            try:
                return await asyncio.to_thread(client.load_lora, body.name, body.path, "api", True)
            except InvalidRequestError as exc:
                raise invalid_request(exc) from None
            except LoraInUseError as exc:
                raise APIError(409, str(exc), param="name", code="lora_in_use") from None

    @app.delete("/v1/loras/{name}", response_model=LoraDeleted, responses=errors)
    async def unload_lora(name: str) -> LoraDeleted:
        """Unload a LoRA adapter no request uses (not a built-in one)."""
        client = engine()
        refuse_builtin(client, name, "unloaded")
        try:
            await asyncio.to_thread(client.unload_lora, name)
        except InvalidRequestError as exc:
            raise APIError(404, f"No LoRA adapter '{name}'.", param="name", code="lora_not_found") from exc
        except LoraInUseError as exc:
            raise APIError(409, str(exc), param="name", code="lora_in_use") from None
        return LoraDeleted(name=name)
