"""Limits on what a client may ask structured output to enforce, checked before llguidance sees it.

llguidance validates a grammar lazily: some that pass its check fail only once the engine runs
them against the tokenizer (an Earley row past its item limit on the first token: a required
property whose schema is the whole schema again, an EBNF rule of 50k alternatives), and some
raise where they should refuse (an integer `minimum` of 10**400). Each limit here turns one of
those into a 400 naming the field, and bounds the cost of the check itself (validation time grows
with the text: at these sizes it stays below ~0.3 s on one core, measured in
tests/server/test_structured_limits.py).
"""

from __future__ import annotations

import json
import math
from typing import Any

from kvrelay.server.errors import bad_request

MAX_SCHEMA_BYTES = 256 << 10  # a JSON schema, as JSON text
MAX_SCHEMA_NODES = 20_000  # objects and arrays in one schema
MAX_SCHEMA_DEPTH = 64  # nested objects and arrays (one schema level is about two)
MAX_INT = 2**63 - 1  # any integer in a schema (minimum, maximum, enum, const, ...)
MAX_REGEX_BYTES = 16 << 10
MAX_GRAMMAR_BYTES = 64 << 10  # EBNF / Lark text
# Alternatives in a whole grammar: llguidance's Earley rows hold 2000 items at most, and the
# alternatives of rules reachable at one position add up in one row.
MAX_ALTERNATIVES = 1000
MAX_CHOICES = 1000  # guided_choice strings
# Bounded repetition ({n}, {n,m}): llguidance's lexer builds its expressions lazily, and nested
# ranges multiply (((a{1,30}){1,30}){1,30}, 27k: "too many expressions constructed" on the
# engine's 6th token; (a{1,300}){1,300} on its 20th). A bound, and the product of the bounds of
# repetitions nested in one another, stay within these (product 1000 ran 40 tokens, measured).
MAX_REPEAT = 10_000
MAX_NESTED_REPEAT = 1000


def check_schema(schema: Any, param: str) -> None:
    """A 400 naming `param` (and the keyword's path inside the schema) for a schema beyond the
    limits: size, nesting, numbers, `format` beside `pattern`, a required self-reference."""
    _walk(schema, param)
    try:
        size = len(json.dumps(schema))
    except (TypeError, ValueError) as e:
        raise bad_request(f"{param}: the schema is not JSON: {e}", param) from None
    if size > MAX_SCHEMA_BYTES:
        raise bad_request(f"{param}: a {size}-byte schema (limit {MAX_SCHEMA_BYTES})", param)
    cycle = _required_cycle(schema)
    if cycle is not None:
        raise bad_request(
            f"{param}: {cycle}: every value would have to contain itself "
            "(a required property, item or allOf refers back to its own schema)",
            param,
        )


def _walk(schema: Any, param: str) -> None:
    stack: list[tuple[Any, str, int]] = [(schema, "", 0)]
    nodes = 0
    while stack:
        value, path, depth = stack.pop()
        where = f"{param}{path}"
        if isinstance(value, bool) or value is None or isinstance(value, str):
            continue
        if isinstance(value, int):
            if abs(value) > MAX_INT:
                raise bad_request(f"{where}: {_short(value)} is beyond 64-bit integers", where)
            continue
        if isinstance(value, float):
            if not math.isfinite(value):
                raise bad_request(f"{where}: {value} is not a finite number", where)
            continue
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise bad_request(f"{param}: more than {MAX_SCHEMA_NODES} objects and arrays", param)
        if depth >= MAX_SCHEMA_DEPTH:
            raise bad_request(f"{where}: nested deeper than {MAX_SCHEMA_DEPTH} levels", where)
        if isinstance(value, dict):
            if isinstance(value.get("pattern"), str):
                check_regex(value["pattern"], f"{where}.pattern")
            if "format" in value and "pattern" in value:
                raise bad_request(
                    f"{where}: `format` and `pattern` together are not supported", where
                )
            stack += [(v, f"{path}.{k}", depth + 1) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]


def _short(n: int) -> str:
    digits = len(str(abs(n))) if abs(n) < 10**4000 else 4000
    return f"an integer of {digits} digits"


def _resolve(root: Any, ref: Any) -> Any:
    """The schema a local `$ref` ("#", "#/$defs/x", any JSON pointer) names; None otherwise."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _forced(root: Any, node: dict) -> list[tuple[str, Any]]:
    """The subschemas every value of `node` must contain a value of (or also satisfy)."""
    out: list[tuple[str, Any]] = []
    if "$ref" in node:
        out.append((f"$ref {node['$ref']}", _resolve(root, node["$ref"])))
    props = node.get("properties")
    required = node.get("required")
    if isinstance(props, dict) and isinstance(required, list):
        out += [(f"required {r!r}", props.get(r)) for r in required if isinstance(r, str)]
    min_items = node.get("minItems", 0)
    if isinstance(min_items, int) and not isinstance(min_items, bool) and min_items > 0:
        prefix = node.get("prefixItems")
        if isinstance(prefix, list) and prefix:
            out += [(f"prefixItems[{i}]", s) for i, s in enumerate(prefix[:min_items])]
        if isinstance(node.get("items"), dict) and not (
            isinstance(prefix, list) and len(prefix) >= min_items
        ):
            out.append(("items", node["items"]))
    if isinstance(node.get("allOf"), list):
        out += [(f"allOf[{i}]", s) for i, s in enumerate(node["allOf"])]
    return [(why, s) for why, s in out if isinstance(s, dict)]


def _required_cycle(root: Any) -> str | None:
    """A chain of forced subschemas from the root back to one already on it (None: none)."""
    if not isinstance(root, dict):
        return None
    state: dict[int, int] = {id(root): 1}  # 1: on the current chain, 2: explored, no cycle
    chain = [(root, iter(_forced(root, root)), "")]
    while chain:  # iterative: a deep schema cannot exhaust Python's stack
        node, edges, _ = chain[-1]
        step = next(edges, None)
        if step is None:
            state[id(node)] = 2
            chain.pop()
            continue
        why, child = step
        seen = state.get(id(child))
        if seen == 1:
            return " -> ".join([w for _, _, w in chain[1:]] + [why])
        if seen is None:
            state[id(child)] = 1
            chain.append((child, iter(_forced(root, child)), why))
    return None


def check_regex(regex: str, param: str) -> None:
    if len(regex.encode()) > MAX_REGEX_BYTES:
        raise bad_request(f"{param}: a regex over {MAX_REGEX_BYTES} bytes", param)
    _check_repetition(regex, param, literals=False)


def _check_repetition(text: str, param: str, literals: bool) -> None:
    single, nested = repetition_bounds(text, literals)
    if single > MAX_REPEAT:
        raise bad_request(f"{param}: a repetition of {single} (limit {MAX_REPEAT})", param)
    if nested > MAX_NESTED_REPEAT:
        raise bad_request(
            f"{param}: nested repetitions multiply to {nested} (limit {MAX_NESTED_REPEAT})",
            param,
        )


def repetition_bounds(text: str, literals: bool = False) -> tuple[int, int]:
    """(the largest {n,m} bound, the largest product of bounds nested in one another) of a regex
    (or, `literals`, a grammar whose quoted strings are skipped). A parse that only follows
    groups, classes, escapes and quantifiers: enough to bound what the lexer may build."""
    stack: list[list[int]] = [[1, 1]]  # per open group: [largest product inside, last atom's]
    single = nested = 1
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        top = stack[-1]
        if c == "\\":
            i += 2
            if text[i - 1 : i] == "x" and text[i : i + 1] == "{":  # \x{...}: one character
                j = text.find("}", i)
                i = n if j < 0 else j + 1
            top[1] = 1
            continue
        if c == "[":
            j = i + 1
            while j < n and text[j] != "]":
                j += 2 if text[j] == "\\" else 1
            i, top[1] = j + 1, 1
            continue
        if literals and c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            i, top[1] = j + 1, 1
            continue
        if c == "(":
            stack.append([1, 1])
        elif c == ")" and len(stack) > 1:
            inner = stack.pop()[0]
            stack[-1][1] = inner
            stack[-1][0] = max(stack[-1][0], inner)
        elif c == "{":
            j = text.find("}", i)
            body = text[i + 1 : j] if j > 0 else ""
            bounds = [b.strip() for b in body.split(",")]
            if j > 0 and 1 <= len(bounds) <= 2 and all(b.isdigit() or b == "" for b in bounds):
                k = max(int(b) for b in bounds if b) if any(bounds) else 1
                single = max(single, k)
                top[1] *= k
                top[0] = max(top[0], top[1])
                nested = max(nested, top[1]) if top[1] != k else nested
                i = j + 1
                continue
            top[1] = 1
        elif c == "|":
            top[1] = 1
        elif c not in "*+?":
            top[1] = 1
            top[0] = max(top[0], 1)
        i += 1
    return single, nested


def check_choices(choices: list[str], param: str) -> None:
    if len(choices) > MAX_CHOICES:
        raise bad_request(f"{param}: {len(choices)} choices (limit {MAX_CHOICES})", param)
    if sum(len(c.encode()) for c in choices) > MAX_GRAMMAR_BYTES:
        raise bad_request(f"{param}: choices over {MAX_GRAMMAR_BYTES} bytes in all", param)


def check_grammar_text(text: str, param: str) -> None:
    """An EBNF / Lark grammar: its size, and its alternatives counted outside literals."""
    if len(text.encode()) > MAX_GRAMMAR_BYTES:
        raise bad_request(f"{param}: a grammar over {MAX_GRAMMAR_BYTES} bytes", param)
    _check_repetition(text, param, literals=True)
    n = count_alternatives(text)
    if n > MAX_ALTERNATIVES:
        raise bad_request(
            f"{param}: {n} alternatives (`|`) in the grammar (limit {MAX_ALTERNATIVES}); "
            "a choice among many strings is better written as a regex or a JSON schema enum",
            param,
        )


def count_alternatives(text: str) -> int:
    """`|` outside string literals, character classes and /regexes/ (and # comments)."""
    n, i, close = 0, 0, ""
    while i < len(text):
        c = text[i]
        if close:
            if c == "\\":
                i += 1
            elif c == close:
                close = ""
        elif c in "\"'":
            close = c
        elif c == "[":
            close = "]"
        elif c == "/" and (i == 0 or text[i - 1] in " \t\n(|:="):
            close = "/"
        elif c == "#":
            j = text.find("\n", i)
            i = len(text) if j < 0 else j
        elif c == "|":
            n += 1
        i += 1
    return n
