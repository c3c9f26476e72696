"""Structured outputs: a request's `response_format` / forced `tool_choice` as an llguidance grammar.

The grammar (llguidance's serialized text) travels to the engine in SamplingParams.grammar; the
engine compiles it against the model's tokenizer and masks every sampling step
(engine/grammar.py). Here, at request validation, it is checked against kvrelay's limits first
(grammar_limits.py: sizes, nesting, numbers, self-requiring schemas, alternatives), then built
and checked by llguidance itself, so a schema it cannot honour is a 400 naming the feature (and
the field), never an engine error.

- response_format text: no grammar; json_object: any JSON object; json_schema: the schema
  (enforced whether `strict` is true or not; unsupported keywords are refused, not ignored).
- tool_choice "required" or a named function: the model's own tool-call format
  (tools/tool_grammar.py); it wins over response_format. "auto" and "none" add no grammar.
- vLLM's guided_choice (the output is one of the strings, verbatim), guided_json (a schema,
  as an object or JSON text), guided_regex, guided_grammar (GBNF or Lark), and its newer
  `structured_outputs` {choice | json | regex | grammar | json_object}. One constraint per
  request (schemas.py refuses two); with a forced tool_choice they are a 400 too.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any

from kvrelay.server import grammar_limits as limits
from kvrelay.server.chat_format import dsv4_thinking
from kvrelay.server.errors import bad_request
from kvrelay.server.schemas import ChatCompletionRequest, NamedToolChoice, ResponseFormat
from kvrelay.server.tools import tool_grammar

ANY_OBJECT = {"type": "object"}


_checked: OrderedDict[bytes, str | None] = OrderedDict()  # digest of a grammar -> its problem
CHECKED_SIZE = 256


def _problem(grammar: str) -> str | None:
    """llguidance's error for this grammar (None: it compiles). Without the tokenizer: a pure
    check of the grammar and its schemas, which is what can be wrong in a request. Remembered
    by digest (an agent sends the same tools every turn; a digest keeps big schemas out)."""
    from llguidance import LLMatcher

    key = hashlib.sha256(grammar.encode()).digest()
    if key in _checked:
        _checked.move_to_end(key)
        return _checked[key]
    try:
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    except Exception as e:  # whatever a client's schema makes llguidance raise is a 400
        is_error, messages = True, [f"{type(e).__name__}: {e}"]
    problem = "; ".join(messages) if is_error else None
    _checked[key] = problem
    if len(_checked) > CHECKED_SIZE:
        _checked.popitem(last=False)
    return problem


def _check(grammar: str, param: str, what: str) -> str:
    problem = _problem(grammar)
    if problem is not None:
        raise bad_request(f"{param}: {what} is not supported: {problem}", param)
    return grammar


def json_schema_grammar(schema: dict[str, Any], param: str) -> str:
    from llguidance import LLMatcher

    limits.check_schema(schema, param)
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, overrides=tool_grammar.JSON_OPTIONS)
    except Exception as e:  # whatever the client's schema makes llguidance raise is a 400
        raise bad_request(f"{param}: this JSON schema is not supported: {e}", param) from None
    return _check(grammar, param, "this JSON schema")


def response_format_grammar(rf: ResponseFormat | None) -> str | None:
    if rf is None or rf.type == "text":
        return None
    schema = ANY_OBJECT
    if rf.type == "json_schema" and rf.json_schema.schema_ is not None:
        schema = rf.json_schema.schema_
    return json_schema_grammar(schema, "response_format")


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of `choices`: every character that is not a letter or a
    digit written as its code point (\\x{..}), so that nothing in a choice is regex syntax."""

    def esc(c: str) -> str:
        return c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}"

    return "(" + "|".join("".join(esc(c) for c in choice) for choice in choices) + ")"


def _schema_of(value, param: str) -> dict[str, Any]:
    """guided_json's schema: an object, JSON text of one, or true (any JSON)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise bad_request(f"{param}: not JSON: {e}", param) from None
    if value is True:
        return {}
    if not isinstance(value, dict):
        raise bad_request(f"{param}: a JSON schema is an object (or true)", param)
    return value


def _regex_grammar(regex: str, param: str, what: str = "this regex") -> str:
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_regex(regex)
    except Exception as e:  # whatever the client's regex makes llguidance raise is a 400
        raise bad_request(f"{param}: {what} is not supported: {e}", param) from None
    return _check(grammar, param, what)


def _ebnf_grammar(text: str, param: str) -> str:
    from llguidance import grammar_from

    limits.check_grammar_text(text, param)
    try:
        grammar = grammar_from("ebnf", text)
    except Exception as e:  # ValueError, or whatever else the client's text makes it raise
        raise bad_request(f"{param}: this grammar is not supported: {e}", param) from None
    return _check(grammar, param, "this grammar")


def guided_grammar(req) -> tuple[str, str] | None:
    """(grammar, field) of vLLM's guided_* / structured_outputs fields (None: none given)."""
    so = req.structured_outputs
    given = [
        (k, getattr(req, k))
        for k in ("guided_choice", "guided_json", "guided_regex", "guided_grammar")
        if getattr(req, k) is not None
    ]
    if so is not None:
        kind = (so.given() or [None])[0]
        if kind is None:
            return None
        value = so.json_ if kind == "json" else getattr(so, kind)
        given = [(f"structured_outputs.{kind}", value)]
    if not given:
        return None
    param, value = given[0]
    kind = param.rsplit("_", 1)[-1].rsplit(".", 1)[-1]
    if kind == "choice":
        limits.check_choices(value, param)
        return _regex_grammar(choice_regex(value), param, "this choice"), param
    if kind == "json":
        return json_schema_grammar(_schema_of(value, param), param), param
    if param == "structured_outputs.json_object":
        return json_schema_grammar(ANY_OBJECT, param), param
    if kind == "regex":
        limits.check_regex(value, param)
        return _regex_grammar(value, param), param
    return _ebnf_grammar(value, param), param


def completion_grammar(req) -> str | None:
    """The grammar a completions request's output must match (None: unconstrained)."""
    guided = guided_grammar(req)
    return guided[0] if guided is not None else response_format_grammar(req.response_format)


def sglang_grammar(p) -> str | None:
    """SGLang's sampling_params json_schema (JSON text), regex or ebnf (at most one)."""
    given = [k for k in ("json_schema", "regex", "ebnf") if getattr(p, k) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise bad_request(f"give one of {', '.join(given)}", f"sampling_params.{given[1]}")
    kind, text = given[0], getattr(p, given[0])
    param = f"sampling_params.{kind}"
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except ValueError as e:
            raise bad_request(f"{param}: not JSON: {e}", param) from None
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise bad_request(f"{param}: a JSON schema is an object (or true)", param)
        return json_schema_grammar(schema, param)
    if kind == "regex":
        limits.check_regex(text, param)
        return _regex_grammar(text, param)
    return _ebnf_grammar(text, param)


def forced_functions(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The functions the model must call (None: tool calls are not forced)."""
    choice = req.tool_choice
    if not req.tools or choice in (None, "none", "auto"):
        return None
    fns = [t.function.model_dump(exclude_none=True) for t in req.tools]
    if isinstance(choice, NamedToolChoice):
        fns = [f for f in fns if f["name"] == choice.function.name]
    return fns


def tool_choice_grammar(req: ChatCompletionRequest, chat_format) -> str | None:
    fns = forced_functions(req)
    if fns is None:
        return None
    names = [t.function.name for t in req.tools]
    for fn in fns:  # each schema on its own first: the 400 names the tool
        params = tool_grammar.parameters(fn)
        i = names.index(fn["name"])
        json_schema_grammar(params, f"tools[{i}].function.parameters")
    parallel = req.parallel_tool_calls is not False
    if chat_format.dsv4:
        think_end = _think_end(chat_format.tokenizer) if dsv4_thinking(req)[0] else None
        lark = tool_grammar.dsml_calls_grammar(fns, parallel, think_end)
    else:
        lark = tool_grammar.json_calls_grammar(fns, parallel)
    from llguidance import LLMatcher

    return _check(LLMatcher.grammar_from_lark(lark), "tool_choice", "forcing these tools")


def _think_end(tokenizer) -> str:
    """`</think>` as a Lark item: its token where the tokenizer has one, else the text."""
    tid = tokenizer.convert_tokens_to_ids("</think>")
    if isinstance(tid, int) and tid != tokenizer.unk_token_id:
        return f"<[{tid}]>"
    return '"</think>"'


def chat_grammar(req: ChatCompletionRequest, chat_format) -> str | None:
    """The grammar a chat request's output must match (None: unconstrained)."""
    grammar = tool_choice_grammar(req, chat_format)
    guided = guided_grammar(req)
    if grammar is not None and guided is not None:
        param = guided[1].split(".")[0]
        raise bad_request(
            f"{param}: give one structured-output constraint, not tool_choice and {param}", param
        )
    if grammar is not None:
        return grammar
    return guided[0] if guided is not None else response_format_grammar(req.response_format)
