"""Request bodies the routes parse themselves, documented in /openapi.json as FastAPI would.

The generation routes take the raw body and parse it on a worker thread (api/server.py),
so FastAPI no longer sees their body models; `document_bodies` puts them back into the
schema (clients, docs and the schema fuzzer of benchmarks/hostile_input.py read it).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"


def document_bodies(app: FastAPI, bodies: Mapping[str, type[BaseModel]]) -> None:
    """`app.openapi()` documents `bodies[path]` as the JSON body of POST `path`."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version,
                                 description=app.description, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in bodies.values()],
                                         ref_template=_REF)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(
                defs.get("$defs", {}))
            for path, model in bodies.items():
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True, "content": {"application/json": {
                        "schema": {"$ref": _REF.format(model=model.__name__)}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
