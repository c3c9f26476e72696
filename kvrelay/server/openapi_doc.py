"""The OpenAPI document of an app whose routes read their bodies themselves (to check the PD
signature over the exact bytes, and to refuse non-strict JSON): each body is described by the
pydantic model the route validates it with, every operation may answer an OpenAI error, and a
generating route may answer JSON or an SSE stream."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"
ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

# One server-sent event: its data is a JSON chunk, an error object, or [DONE].
SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}}}


def document_bodies(
    app: FastAPI,
    bodies: dict[tuple[str, str], type[BaseModel]],
    streams: frozenset[tuple[str, str]] = frozenset(),
) -> None:
    """`bodies`: (method, path) -> the request body's model. `streams`: the operations that may
    answer text/event-stream."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        schemas.pop("HTTPValidationError", None)  # validation errors are 400s in OpenAI's shape
        schemas.pop("ValidationError", None)
        schemas["ErrorResponse"] = ERROR_SCHEMA
        error = {
            "description": "an OpenAI-format error",
            "content": {
                "application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}
            },
        }
        for (method, path), model in bodies.items():
            js = model.model_json_schema(ref_template=_REF)
            schemas.update(js.pop("$defs", {}))
            schemas[model.__name__] = js
            op = doc["paths"][path][method.lower()]
            op["requestBody"] = {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}
                },
            }
        for path, item in doc["paths"].items():
            for method, op in item.items():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                responses["default"] = error
                if (method.upper(), path) in streams:
                    ok = responses.setdefault("200", {"description": "OK"})
                    ok.setdefault("content", {})["text/event-stream"] = {"schema": SSE_EVENT}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
