"""OpenAI request bodies, validated: anything out of range is a 400 with the field named.

Integers are bounded (nothing a client sends may overflow the engine's int64 messages), floats
are finite, and every shape the code reads is declared, so a wrong shape is a 400, never a crash
further in. The sampling fields default to None: "not given", so that the model's own generation
defaults apply (generation_defaults.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

INT32_MAX = 2**31 - 1
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Positive = Annotated[int, Field(ge=1, le=INT32_MAX)]
# Prompts in one batched request (completions: prompts x n), SGLang's /generate: each is an
# engine request (through the PD router a PD request).
MAX_BATCH_PROMPTS = 1024


def child_seed(seed: int, index: int) -> int:
    """Sample `index`'s seed of a request with n samples (vLLM's children: seed + index), kept
    in the int64 range the seed field allows (index 0: seed). The PD router seeds the samples
    it sends one by one with the same."""
    return (seed + index + 2**63) % 2**64 - 2**63


class FieldError(ValueError):
    """A check across fields that names the one to blame (validation.py reads `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def check_prompts(v, empty: str):
    """A prompt or a batch of them (strings or token-id lists): none empty (`empty` is the
    message), at most MAX_BATCH_PROMPTS; a batch's empty prompt is named by its index."""
    if isinstance(v, list | str) and len(v) == 0:
        raise ValueError(empty)
    if isinstance(v, list) and isinstance(v[0], str | list):
        if len(v) > MAX_BATCH_PROMPTS:
            raise ValueError(f"at most {MAX_BATCH_PROMPTS} prompts in one request")
        for i, p in enumerate(v):
            if len(p) == 0:
                raise FieldError(f"[{i}]", empty)
    return v


def stop_list(v) -> list[str]:
    """`stop` as a list: one string or a list of at most 16 non-empty strings."""
    stops = [v] if isinstance(v, str) else (v or [])
    if len(stops) > 16 or any(not s for s in stops):
        raise ValueError("at most 16 non-empty stop strings")
    return stops


# strict: a value of the declared type only (a boolean is not an integer, "5" is not a number).
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)


class StreamOptions(_Open):
    include_usage: bool = False


class JsonSchemaFormat(_Open):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: text (no constraint), json_object (any JSON object) or
    json_schema (output valid for the schema; enforced whether or not `strict` is set)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: one of choice, json, regex, grammar, json_object (any other
    key, structural_tag included, is refused: extra="forbid")."""

    choice: list[str] | None = Field(default=None, min_length=1, max_length=1024)
    json_: dict[str, Any] | str | bool | None = Field(default=None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _one(self):
        given = self.given()
        if len(given) > 1:
            raise FieldError(
                given[1],
                f"give one of choice, json, regex, grammar, json_object, not {' and '.join(given)}",
            )
        return self

    def given(self) -> list[str]:
        out = [k for k in ("choice", "regex", "grammar") if getattr(self, k) is not None]
        if self.json_ is not None:
            out.append("json")
        if self.json_object:
            out.append("json_object")
        return out


# vLLM's structured-output fields (honoured: structured.py); at most one constraint per request.
GUIDED = ("guided_choice", "guided_json", "guided_regex", "guided_grammar", "structured_outputs")


class _Sampling(_Open):
    """Unknown fields are accepted and ignored; known ones that would change the answer in a way
    kvrelay does not implement are refused (logit_bias, repetition_penalty != 1)."""

    model: str
    max_tokens: Positive | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX, description="-1 or 0: off")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    n: Positive = 1
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=256)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    ignore_eos: bool = False
    user: str | None = None
    # vLLM's: each prompt token's logprob and top alternatives (server/prompt_logprobs.py).
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    # vLLM's extras with the values that change nothing; any other value is refused.
    repetition_penalty: float | None = Field(default=None, description="only 1 is supported")
    logit_bias: dict[str, float] | None = Field(default=None, description="not supported")
    # vLLM's extras, honoured: EOS and stop tokens/strings cannot end the output before
    # min_tokens tokens; the matched stop string kept; the prompt cut to its last N tokens;
    # logprobs' tokens as "token_id:<id>"; structured outputs (structured.py).
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] = 0
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: Positive | None = None
    return_tokens_as_token_ids: bool = False
    guided_choice: list[str] | None = Field(default=None, min_length=1, max_length=1024)
    guided_json: dict[str, Any] | str | bool | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's with the neutral value only: other values are refused, never ignored.
    guided_whitespace_pattern: None = Field(default=None, description="not supported")
    guided_decoding_backend: str | None = Field(default=None, description="ignored: llguidance")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        return stop_list(v)

    @model_validator(mode="after")
    def _sampling_checks(self):
        given = [k for k in GUIDED if getattr(self, k) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.insert(0, "response_format")
        if len(given) > 1:
            raise FieldError(
                given[1], f"give one structured-output constraint, not {' and '.join(given)}"
            )
        limit = getattr(self, "max_completion_tokens", None) or self.max_tokens
        if limit is not None and self.min_tokens > limit:
            raise FieldError("min_tokens", f"{self.min_tokens} is more than max_tokens ({limit})")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _no_repetition_penalty(cls, v):
        if v is not None and v != 1.0:
            raise ValueError("repetition_penalty is not supported (only 1, which changes nothing)")
        return v

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])


class ContentPart(_Open):
    type: str
    text: str | None = None


class FunctionCall(_Open):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCallIn(_Open):
    """A tool call in an assistant message of the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def text(self) -> str | None:
        if isinstance(self.content, list):
            parts = [p.text for p in self.content if p.type == "text" and p.text is not None]
            if len(parts) != len(self.content):
                raise ValueError("only text content parts are supported")
            return "".join(parts)
        return self.content


class FunctionDef(_Open):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Open):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Positive | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call (a grammar enforces it)
    # Thinking switch as vLLM/SGLang read it for DeepSeek: {"thinking": true} (or enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    # vLLM's: the template continues the last (assistant) message instead of opening a new
    # turn; add_generation_prompt false renders no assistant header (HF templates only).
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v, info: ValidationInfo):
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice_in_tools(cls, v, info: ValidationInfo):
        tools = info.data.get("tools")  # absent when tools itself failed validation
        if v not in (None, "none", "auto") and not tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(v, NamedToolChoice) and v.function.name not in {
            t.function.name for t in tools
        }:
            raise ValueError(f"tool_choice names {v.function.name!r}, which is not among the tools")
        return v

    @model_validator(mode="after")
    def _merge(self):
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise FieldError(
                    "add_generation_prompt", "cannot be true with continue_final_message"
                )
            if self.messages[-1].role != "assistant":
                raise FieldError(
                    "continue_final_message", "the last message must be the assistant's"
                )
        return self

    @property
    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as plain JSON objects (what chat templates and encoders read)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = Field(
        default=None, description="0 only with echo (the prompt's logprobs alone)"
    )
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(default=None, description="only 1 is supported")
    suffix: str | None = Field(default=None, description="not supported")

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v):
        if v is not None and v != 1:
            raise ValueError("best_of other than 1 is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix (insertion) is not supported")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        return check_prompts(v, "prompt is empty")

    @model_validator(mode="after")
    def _batch_size(self):
        if len(self.prompts) * self.n > MAX_BATCH_PROMPTS:
            raise FieldError(
                "n", f"{len(self.prompts)} prompts x n={self.n} is more than {MAX_BATCH_PROMPTS}"
            )
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch: one entry per prompt (a string or token ids); a single prompt is a batch
        of one. Choice `index` is prompt_i * n + sample_j (as vLLM and OpenAI number them)."""
        p = self.prompt
        return list(p) if isinstance(p, list) and isinstance(p[0], str | list) else [p]

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs
