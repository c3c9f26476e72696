"""Request bodies from bytes to validated models: strict JSON, then the schema, every failure a 400
that names the offending field (`param`), for any bytes a client can send. Shared by the server
and the router."""

from __future__ import annotations

import json
import math

from pydantic import BaseModel, ValidationError

from kvrelay.server.errors import APIError, bad_request
from kvrelay.server.schemas import FieldError

MAX_DEPTH = 64  # JSON nesting; deeper bodies are refused before anything walks them recursively


class _NonFinite(float):
    """Stands in for NaN / Infinity / an overflowing number until the walk names its field."""

    def __new__(cls, token: str) -> _NonFinite:
        obj = super().__new__(cls, math.nan)
        obj.token = token
        return obj


def _parse_float(s: str) -> float:
    x = float(s)
    return x if math.isfinite(x) else _NonFinite(s)


def param_path(loc: tuple | list) -> str | None:
    """OpenAI's spelling of a field path: messages[0].content."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def parse_json(body: bytes) -> dict:
    """The body as a JSON object. Refuses what is not strict JSON (NaN, Infinity, numbers that
    overflow a double), lone UTF-16 surrogates (no tokenizer can encode them) and nesting deeper
    than MAX_DEPTH."""
    try:
        data = json.loads(body, parse_constant=_NonFinite, parse_float=_parse_float)
    except RecursionError:
        raise bad_request(f"the JSON body is nested deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, over-long integers
        raise bad_request(f"malformed JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    _check_tree(data)
    return data


def _check_tree(root: dict) -> None:
    stack: list[tuple[object, tuple, int]] = [(root, (), 0)]
    while stack:
        value, loc, depth = stack.pop()
        if isinstance(value, _NonFinite):
            raise bad_request(
                f"{param_path(loc)}: {value.token} is not a valid number (JSON numbers are finite)",
                param_path(loc),
            )
        if isinstance(value, str):
            _check_text(value, loc)
        elif isinstance(value, dict | list):
            if depth >= MAX_DEPTH:
                raise bad_request(
                    f"the JSON body is nested deeper than {MAX_DEPTH} levels", param_path(loc)
                )
            if isinstance(value, dict):
                for k, v in value.items():
                    _check_text(k, loc)
                    stack.append((v, (*loc, k), depth + 1))
            else:
                stack.extend((v, (*loc, i), depth + 1) for i, v in enumerate(value))


def _check_text(s: str, loc: tuple) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        p = param_path(loc)
        raise bad_request(
            f"{p or 'body'}: the text contains a lone UTF-16 surrogate (\\ud800-\\udfff), "
            "which is not valid Unicode",
            p,
        ) from None


def validate(schema: type[BaseModel], data: dict) -> BaseModel:
    """`data` as `schema`; a 400 naming the first offending field otherwise."""
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise _schema_error(e, data) from None


def _schema_error(e: ValidationError, data: dict) -> APIError:
    errors = [(_param(err, data), _message(err)) for err in e.errors()]
    # A union reports one error per member: the one deepest into the request says most (a
    # list of ints with one too large: that element), and those on the same field go together.
    param = max(errors, key=lambda pe: len(pe[0] or ""))[0]
    msgs = []
    for p, m in errors:
        if p == param and m not in msgs:
            msgs.append(m)
    msg = " or ".join(msgs[:3])
    return bad_request(f"{param}: {msg}" if param else msg, param)


def _param(err: dict, data: dict) -> str | None:
    cause = (err.get("ctx") or {}).get("error")
    prefix = _data_path(err["loc"], data)
    if isinstance(cause, FieldError):  # a check across fields names its field itself
        if not prefix:
            return cause.param
        return prefix + (cause.param if cause.param.startswith("[") else f".{cause.param}")
    return prefix


def _message(err: dict) -> str:
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        return str(cause).removeprefix(f"{cause.param}: ")
    if err["type"] == "extra_forbidden":
        return "this field is not supported"
    if isinstance(err.get("input"), bool) and err["type"] in ("int_type", "float_type"):
        return f"{err['msg']} (a boolean is not a number)"
    return err["msg"].removeprefix("Value error, ")


def _data_path(loc: tuple, data: object) -> str | None:
    """The part of pydantic's location that indexes the request (it also names union members,
    'str', 'list[int]'…, which are not fields)."""
    path: list = []
    node = data
    for i, part in enumerate(loc):
        if isinstance(node, dict) and isinstance(part, str):
            if part in node:
                path.append(part)
                node = node[part]
            elif i == len(loc) - 1 and _field_like(part):  # a missing field
                path.append(part)
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            path.append(part)
            node = node[part]
    return param_path(path)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


def _field_like(part: str) -> bool:
    return part.isidentifier() and not part[0].isupper() and part not in _TYPE_TAGS
