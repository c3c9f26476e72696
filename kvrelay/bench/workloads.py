"""What the benchmark sends: random fixed-length prompts, shared-prefix multi-turn chat, and an
agentic tool-call loop with deterministic simulated tools.

Every workload is a list of sessions; a session yields its requests one turn at a time, because a
later turn's request contains the earlier turns' real outputs. Prompt text is plain English words,
so it needs no tokenizer on the client: a calibration (two probe requests, see loadgen) measures
how many tokens a word costs on the server, and text is sized from that.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass, field

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
DATASETS = ("random", "shared-prefix-chat", "agentic")

# Common English words: one token each (with their leading space) in most BPE vocabularies.
WORDS = tuple(
    """
    the of and to in is was for on are with as at be by this have from or one had not but what all
    were when we there can an your which their said if do will each about how up out them then she
    many some so these would other into has more her two like him see time could no make than first
    been its who now people my made over did down only way find use may water long little very after
    words called just where most know get through back much before go good new write our used me man
    too any day same right look think also around another came come work three word must because does
    part even place well such here take why things help put years different away again off went old
    number great tell men say small every found still between name should home big give air line set
    own under read last never us left end along while might next sound below saw something thought
    both few those always looked show large often together asked house world going want school
    important until form food keep children feet land side without boy once animals life enough took
    sometimes four head above kind began almost live page got earth need far hand high year mother
    light country father let night following picture being study second eyes soon times story boys
    since white days paper hard near sentence better best across during today others however sure
    means knew try told young miles sun ways thing whole hear example heard several change answer
    room sea against top turned learn point city play toward five using himself usually money seen
    car morning body upon family later move face door cut done group true leave color red friends
    easy order open ground cold really table remember tree course front river early hold music
    """.split()
)

TOOLS: list[dict] = [
    {
        "type": "function",
        "function": {
            "name": "search_code",
            "description": "Search the repository for a text query and return matching lines.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "text to search for"},
                    "max_results": {"type": "integer", "minimum": 1, "maximum": 50},
                },
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "start_line": {"type": "integer", "minimum": 1},
                },
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run a test target and return its output.",
            "parameters": {
                "type": "object",
                "properties": {"target": {"type": "string"}},
                "required": ["target"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "edit_file",
            "description": "Replace text in a file.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "old": {"type": "string"},
                    "new": {"type": "string"},
                },
                "required": ["path", "old", "new"],
            },
        },
    },
]
TOOL_NAMES = frozenset(t["function"]["name"] for t in TOOLS)


@dataclass(frozen=True)
class TextCalibration:
    """Server tokens ~= offset + tokens_per_word * words for one request of plain text."""

    tokens_per_word: float = 1.0
    offset: float = 0.0  # what the request adds around the text: BOS, chat template

    def words_for(self, tokens: float) -> int:
        return max(1, round(tokens / max(self.tokens_per_word, 1e-3)))


def random_text(rng: random.Random, n_tokens: float, cal: TextCalibration) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(cal.words_for(n_tokens)))


@dataclass(frozen=True)
class WorkloadConfig:
    dataset: str = "random"
    endpoint: str = COMPLETIONS  # random may use either; the chat workloads need CHAT
    input_len: int = 1024  # random: prompt; chat: each user turn; agentic: the task
    output_len: int = 128  # max_tokens of every request
    range_ratio: float = 0.0  # random: lengths uniform in [len*(1-r), len*(1+r)] (vLLM's meaning)
    prefix_len: int = 1024  # chat/agentic: the system prompt shared by a group of sessions
    num_prefix_groups: int = 4
    num_turns: int = 4  # requests per session (chat and agentic)
    tool_result_len: int = 256  # agentic: tokens of each simulated tool result
    ignore_eos: bool = True
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"unknown dataset {self.dataset!r}; choose from {', '.join(DATASETS)}")
        if self.endpoint not in (COMPLETIONS, CHAT):
            raise ValueError(f"endpoint must be {COMPLETIONS} or {CHAT}")
        if self.dataset != "random" and self.endpoint != CHAT:
            raise ValueError(f"the {self.dataset} workload needs {CHAT}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError("range_ratio must be in [0, 1)")
        for name in ("input_len", "output_len", "num_prefix_groups", "num_turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in ("prefix_len", "tool_result_len"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")

    @property
    def turns_per_session(self) -> int:
        return 1 if self.dataset == "random" else self.num_turns


@dataclass
class RequestSpec:
    endpoint: str
    body: dict  # sampling fields and prompt/messages; the load generator adds model and stream


@dataclass
class Response:
    """What a session needs from a finished turn to build the next one."""

    text: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str | None = None


class Session:
    """A conversation: `next_request()` until it returns None, `record()` after each response."""

    def __init__(self, session_id: str, num_turns: int) -> None:
        self.session_id = session_id
        self.num_turns = num_turns
        self.turn = 0

    def next_request(self) -> RequestSpec | None:
        raise NotImplementedError

    def record(self, response: Response) -> None:
        self.turn += 1


def _sampling(cfg: WorkloadConfig, max_tokens: int) -> dict:
    return {"max_tokens": max_tokens, "temperature": cfg.temperature, "ignore_eos": cfg.ignore_eos}


class RandomSession(Session):
    """One request of a fixed (or ratio-ranged) prompt and output length."""

    def __init__(self, session_id: str, cfg: WorkloadConfig, text: str, max_tokens: int) -> None:
        super().__init__(session_id, 1)
        self.cfg, self.text, self.max_tokens = cfg, text, max_tokens

    def next_request(self) -> RequestSpec | None:
        if self.turn >= 1:
            return None
        body = _sampling(self.cfg, self.max_tokens)
        if self.cfg.endpoint == CHAT:
            body["messages"] = [{"role": "user", "content": self.text}]
        else:
            body["prompt"] = self.text
        return RequestSpec(self.cfg.endpoint, body)


class ChatSession(Session):
    """Multi-turn chat under a system prompt shared with the other sessions of its group."""

    def __init__(
        self, session_id: str, cfg: WorkloadConfig, system: str, user_turns: list[str]
    ) -> None:
        super().__init__(session_id, len(user_turns))
        self.cfg, self.user_turns = cfg, user_turns
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.messages.append({"role": "user", "content": user_turns[0]})

    def next_request(self) -> RequestSpec | None:
        if self.turn >= self.num_turns:
            return None
        body = _sampling(self.cfg, self.cfg.output_len)
        body["messages"] = [dict(m) for m in self.messages]
        return RequestSpec(CHAT, body)

    def record(self, response: Response) -> None:
        super().record(response)
        self.messages.append({"role": "assistant", "content": response.text})
        if self.turn < self.num_turns:
            self.messages.append({"role": "user", "content": self.user_turns[self.turn]})


class AgentSession(Session):
    """An agent loop: every turn but the last ends in a tool call whose result is appended.

    The model's own tool calls are used when the server returns valid ones; otherwise the session
    makes a scripted call, so the traffic shape (context growth, tool messages) does not depend on
    how well a small model follows the tool format.
    """

    def __init__(
        self,
        session_id: str,
        index: int,
        cfg: WorkloadConfig,
        system: str,
        task: str,
        cal: TextCalibration,
        seed: int,
    ) -> None:
        super().__init__(session_id, cfg.num_turns)
        self.index, self.cfg, self.cal, self.seed = index, cfg, cal, seed
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.messages.append({"role": "user", "content": task})
        self.model_tool_calls = 0
        self.scripted_tool_calls = 0

    def next_request(self) -> RequestSpec | None:
        if self.turn >= self.num_turns:
            return None
        body = _sampling(self.cfg, self.cfg.output_len)
        body |= {
            "messages": [dict(m) for m in self.messages],
            "tools": TOOLS,
            "tool_choice": "auto",
        }
        return RequestSpec(CHAT, body)

    def record(self, response: Response) -> None:
        super().record(response)
        if self.turn >= self.num_turns:  # the final answer
            self.messages.append({"role": "assistant", "content": response.text})
            return
        calls = [c for c in response.tool_calls if valid_tool_call(c)]
        if calls:
            self.model_tool_calls += len(calls)
        else:
            calls = [scripted_tool_call(self.seed, self.index, self.turn)]
            self.scripted_tool_calls += 1
        self.messages.append({"role": "assistant", "content": response.text, "tool_calls": calls})
        for c in calls:
            content = tool_result(
                c["function"]["name"],
                c["function"]["arguments"],
                self.cfg.tool_result_len,
                self.cal,
            )
            self.messages.append({"role": "tool", "tool_call_id": c["id"], "content": content})


def valid_tool_call(call: dict) -> bool:
    fn = call.get("function") or {}
    if fn.get("name") not in TOOL_NAMES or not call.get("id"):
        return False
    try:
        return isinstance(json.loads(fn.get("arguments") or ""), dict)
    except (json.JSONDecodeError, TypeError):
        return False


def scripted_tool_call(seed: int, session_index: int, turn: int) -> dict:
    """The call a scripted agent makes at this turn: deterministic in (seed, session, turn)."""
    rng = random.Random(f"{seed}/{session_index}/{turn}")
    a, b = rng.choice(WORDS), rng.choice(WORDS)
    name = TOOLS[(session_index + turn) % len(TOOLS)]["function"]["name"]
    args = {
        "search_code": {"query": f"{a} {b}", "max_results": 10},
        "read_file": {"path": f"src/{a}/{b}.py", "start_line": 1},
        "run_tests": {"target": f"tests/test_{a}.py"},
        "edit_file": {"path": f"src/{a}/{b}.py", "old": a, "new": b},
    }[name]
    return {
        "id": f"call_{session_index}_{turn}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }


def tool_result(name: str, arguments: str, n_tokens: int, cal: TextCalibration) -> str:
    """A simulated tool's output: a pure function of the call, like a real read-only tool."""
    digest = hashlib.sha256(f"{name}\0{arguments}".encode()).hexdigest()
    text = random_text(random.Random(digest), n_tokens, cal) if n_tokens else ""
    return json.dumps({"status": "ok", "tool": name, "output": text})


def build_sessions(
    cfg: WorkloadConfig, num_requests: int, seed: int, cal: TextCalibration
) -> list[Session]:
    """Sessions holding `num_requests` requests in all (rounded up to whole sessions)."""
    rng = random.Random(seed)
    turns = cfg.turns_per_session
    n = max(1, math.ceil(num_requests / turns))
    if cfg.dataset == "random":
        return [_random_session(f"s{i}", cfg, rng, cal) for i in range(n)]
    groups = [
        random_text(rng, cfg.prefix_len, cal) if cfg.prefix_len else ""
        for _ in range(cfg.num_prefix_groups)
    ]
    sessions: list[Session] = []
    for i in range(n):
        system = groups[i % len(groups)]
        if cfg.dataset == "shared-prefix-chat":
            user_turns = [random_text(rng, cfg.input_len, cal) for _ in range(turns)]
            sessions.append(ChatSession(f"s{i}", cfg, system, user_turns))
        else:
            task = random_text(rng, cfg.input_len, cal)
            sessions.append(AgentSession(f"s{i}", i, cfg, system, task, cal, seed))
    return sessions


def _random_session(
    sid: str, cfg: WorkloadConfig, rng: random.Random, cal: TextCalibration
) -> RandomSession:
    r = cfg.range_ratio
    in_len = rng.randint(math.floor(cfg.input_len * (1 - r)), math.ceil(cfg.input_len * (1 + r)))
    out_len = rng.randint(
        max(1, math.floor(cfg.output_len * (1 - r))), math.ceil(cfg.output_len * (1 + r))
    )
    # The request's own overhead (BOS, chat template) counts toward its prompt length.
    return RandomSession(sid, cfg, random_text(rng, max(in_len - cal.offset, 1), cal), out_len)
