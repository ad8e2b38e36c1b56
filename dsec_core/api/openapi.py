"""The OpenAPI 3.1 document of the node API, generated from the route table and the type hints
of its messages: what ``dsec node openapi`` prints, ``GET /v1/openapi.json`` serves, and API
fuzzers such as schemathesis read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .. import __version__
from .messages import ErrorResponse
from .routes import MAX_DEPTH, RAW, ROUTES, Route
from .shapes import json_schema

__all__ = ["openapi_document"]

_DESCRIPTION = (
    "The API of one dsec node daemon. Locally it is served on a root-only unix socket and "
    "needs no token; on TCP (DSEC_LISTEN) every request carries `Authorization: Bearer "
    '<DSEC_API_TOKEN>`. Every error answer is `{"error": {"type", "message", '
    '"context"}}`, where `type` names the DsecError subclass the SDK raises. A request line '
    "and headers over DSEC_MAX_HEADER_BYTES (64 KiB) are 431 HeadersTooLarge, and ones not "
    "complete within DSEC_HEADER_TIMEOUT (10 s) 408 RequestTimeout, both closing the "
    "connection; a body over its operation's `x-max-body` bytes is 413 RequestTooLarge, one "
    "that stalls for DSEC_BODY_TIMEOUT (30 s) 408 RequestTimeout, and a JSON body nesting "
    f"arrays and objects more than {MAX_DEPTH} deep 422 InvalidSpec."
)


def openapi_document(more: Mapping[str, Route] | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 document of every route in ``ROUTES``, and of ``more`` (an apiserver's
    own: IAM's ``IAM_ROUTES``)."""
    schemas: dict[str, Any] = {}
    paths: dict[str, dict[str, Any]] = {}
    for route in [*ROUTES.values(), *(more or {}).values()]:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route, schemas)
    error = json_schema(ErrorResponse, schemas)
    return {
        "openapi": "3.1.0",
        "info": {"title": "dsec node API", "version": __version__, "description": _DESCRIPTION},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "responses": {
                "Error": {
                    "description": "A typed error (DsecError)",
                    "content": {"application/json": {"schema": error}},
                }
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        # a token on TCP; none on the unix socket
        "security": [{"bearer": []}, {}],
    }


def _operation(route: Route, schemas: dict[str, Any]) -> dict[str, Any]:
    op: dict[str, Any] = {"operationId": route.name, "summary": route.summary}
    params = [
        {"name": p, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
        for p in route.params
    ]
    if route.query is not None:
        params += _query_parameters(route.query)
    if params:
        op["parameters"] = params
    if route.body is not None:
        op["x-max-body"] = route.max_body
    if route.body is RAW:
        op["requestBody"] = {
            "description": f"At most {route.max_body} bytes (DSEC_MAX_UPLOAD)",
            "required": True,
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
            },
        }
    elif route.body is not None:
        required = any(
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            for f in dataclasses.fields(route.body)
        )
        op["requestBody"] = {
            "description": f"At most {route.max_body} bytes, nested at most {MAX_DEPTH} deep",
            "required": required,
            "content": {"application/json": {"schema": json_schema(route.body, schemas)}},
        }
    if route.response is RAW:
        content = {route.raw_type: {"schema": {"type": "string", "format": "binary"}}}
    elif route.response is dict:
        content = {"application/json": {"schema": {"type": "object"}}}
    else:
        content = {"application/json": {"schema": json_schema(route.response, schemas)}}
    error = {"$ref": "#/components/responses/Error"}
    op["responses"] = {
        str(route.status): {"description": route.summary, "content": content},
        "4XX": error,
        "5XX": error,
    }
    return op


def _query_parameters(query: type) -> list[dict[str, Any]]:
    """One parameter per field of the query message, with its type, constraints and default
    (the message itself is no component: its fields are scalars)."""
    own: dict[str, Any] = {}
    json_schema(query, own)
    record = own[query.__name__]
    required = set(record.get("required", ()))
    return [
        {"name": name, "in": "query", "required": name in required, "schema": _scalar(schema)}
        for name, schema in record["properties"].items()
    ]


def _scalar(schema: dict[str, Any]) -> dict[str, Any]:
    """A query parameter's schema: optional ones are left out rather than sent as null."""
    kinds = schema.get("type")
    if isinstance(kinds, list) and "null" in kinds:
        schema = {**schema, "type": next(k for k in kinds if k != "null")}
        if schema.get("default", 0) is None:  # left out is the default, not a null
            del schema["default"]
    return schema
