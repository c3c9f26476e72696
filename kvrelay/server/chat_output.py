"""Model output text → OpenAI chat fields: content, reasoning_content and tool_calls.

One `ChatOutputParser` serves both response kinds: a stream feeds it each text delta, a whole
response feeds it the whole text. Both use the same state machines, so what the OpenAI client
accumulates from the stream equals the whole response.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvrelay.server.tools.dsml import ContentDelta, ToolCallDelta
from kvrelay.server.tools.dsv4_chat import ReasoningStreamSplitter


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


Piece = ContentDelta | ReasoningDelta | ToolCallDelta


class ToolParser(Protocol):
    errors: list[str]

    def feed(self, piece: str) -> list[ContentDelta | ToolCallDelta]: ...

    def finish(self, truncated: bool = False) -> list[ContentDelta | ToolCallDelta]: ...


class ChatOutputParser:
    """Splits reasoning off (thinking mode), then tool calls off the content (with tools)."""

    def __init__(self, tools: ToolParser | None = None, reasoning: bool = False) -> None:
        self.tools = tools
        self.reasoning = reasoning
        self._splitter = ReasoningStreamSplitter() if reasoning else None
        self.tool_calls = 0

    @property
    def errors(self) -> list[str]:
        return self.tools.errors if self.tools is not None else []

    def feed(self, text: str) -> list[Piece]:
        reasoning, content = self._splitter.feed(text) if self._splitter else ("", text)
        return self._route(reasoning, content, final=False)

    def finish(self, truncated: bool = False) -> list[Piece]:
        """`truncated`: the output stopped at max_tokens, so a call still open is cut off (it
        stays content, never a call)."""
        reasoning, content = self._splitter.finish() if self._splitter else ("", "")
        return self._route(reasoning, content, final=True, truncated=truncated)

    def step(self, text: str, final: bool, truncated: bool = False) -> list[Piece]:
        """One stream step: this text, and everything held back when it is the last."""
        return self.feed(text) + (self.finish(truncated) if final else [])

    def _route(
        self, reasoning: str, content: str, final: bool, truncated: bool = False
    ) -> list[Piece]:
        out: list[Piece] = [ReasoningDelta(reasoning)] if reasoning else []
        if self.tools is None:
            out += [ContentDelta(content)] if content else []
        else:
            out += self.tools.feed(content) if content else []
            out += self.tools.finish(truncated) if final else []
        self.tool_calls += sum(isinstance(p, ToolCallDelta) for p in out)
        return out


def tool_call_dict(p: ToolCallDelta) -> dict:
    """One entry of `tool_calls` (a streamed delta carries `index` as well)."""
    fn: dict = {"arguments": p.arguments}
    if p.name is not None:
        fn = {"name": p.name, **fn}
    d: dict = {"index": p.index}
    if p.id is not None:
        d |= {"id": p.id, "type": "function"}
    return d | {"function": fn}


def delta_dict(pieces: list[Piece]) -> dict:
    """The `delta` of one stream chunk carrying these pieces."""
    d: dict = {}
    for p in pieces:
        if isinstance(p, ToolCallDelta):
            d.setdefault("tool_calls", []).append(tool_call_dict(p))
        else:
            key = "reasoning_content" if isinstance(p, ReasoningDelta) else "content"
            d[key] = d.get(key, "") + p.text
    return d


def message_dict(pieces: list[Piece], reasoning: bool) -> dict:
    """The `message` of a whole response (content null when there is none, as OpenAI does)."""
    content = "".join(p.text for p in pieces if isinstance(p, ContentDelta))
    msg: dict = {"role": "assistant", "content": content or None}
    if reasoning:
        text = "".join(p.text for p in pieces if isinstance(p, ReasoningDelta))
        msg["reasoning_content"] = text or None
    calls = [p for p in pieces if isinstance(p, ToolCallDelta)]
    if calls:
        msg["tool_calls"] = [
            {k: v for k, v in tool_call_dict(c).items() if k != "index"} for c in calls
        ]
    return msg
