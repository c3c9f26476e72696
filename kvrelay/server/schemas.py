"""OpenAI request bodies, validated: anything out of range is a 400 with the field named."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields are accepted and ignored

    model: str
    max_tokens: int | None = Field(default=None)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError("must be at least 1")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("at most 16 non-empty stop strings")
        return stops

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str | None:
        if isinstance(self.content, list):
            parts = [p.get("text", "") for p in self.content if p.get("type") == "text"]
            if len(parts) != len(self.content):
                raise ValueError("only text content parts are supported")
            return "".join(parts)
        return self.content


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # Thinking switch as vLLM/SGLang read it for DeepSeek: {"thinking": true} (or enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v):
        if isinstance(v, str) and v not in ("none", "auto", "required"):
            raise ValueError('must be "none", "auto", "required" or a named function')
        if isinstance(v, dict) and not isinstance((v.get("function") or {}).get("name"), str):
            raise ValueError('a named tool_choice is {"type": "function", "function": {"name": …}}')
        return v

    @model_validator(mode="after")
    def _merge(self):
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if self.max_completion_tokens is not None:
            if self.max_completion_tokens <= 0:
                raise ValueError("max_completion_tokens must be at least 1")
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported; send one prompt per request")
            v = v[0]
        if isinstance(v, list | str) and len(v) == 0:
            raise ValueError("prompt is empty")
        return v

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs
