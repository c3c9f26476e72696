"""A request's state inside the engine."""

from __future__ import annotations

import enum

import torch

from kvrelay.engine.messages import PromptLogprob, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    RESERVED = "reserved"  # KV held for a transfer still arriving (PD decode); not scheduled
    HELD = "held"  # an n sample waiting for its leader's prompt to be cached (siblings.py)
    FINISHED = "finished"


class Request:
    def __init__(
        self, rid: str, prompt_ids: list[int], params: SamplingParams, arrival: int
    ) -> None:
        self.rid = rid
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.arrival = arrival  # admission order; preemption evicts the newest first
        self.status = Status.WAITING
        self.pages: list[int] = []
        self.state_slot = 0  # models with per-request state (DeepSeek-V4 compressors): its slot
        self.num_computed = 0  # tokens whose K/V sit in the cache
        # Prefix cache: the node its shared pages end at (None: it shares none), and how many
        # prompt tokens the cache provided when it was first admitted (for usage).
        self.prefix_node = None
        self.num_cached_tokens = 0
        # tokens the latest prefix-cache match provided (the runner resumes per-request state,
        # e.g. DeepSeek-V4's compressors, from the last matched page on the step that starts there)
        self.matched_tokens = 0
        self.cache_queried = False
        # Its own pages ending before this token lack rows a request resuming at their end reads
        # (a PD decode receives a window's older rows only where a later hit can resume); 0: none
        self.resume_from = 0
        self.group: str | None = None  # n samples of one prompt share it (siblings.py)
        self.generator: torch.Generator | None = None
        self.finish_reason: str | None = None
        self.matcher = None  # llguidance LLMatcher of a grammar-constrained request (grammar.py)
        self.grammar_consumed = 0  # output tokens the matcher has consumed
        self.draft_index = None  # speculative decoding: its n-gram index (engine/drafter.py)
        # mtp: the draft its last step's MTP pass made, for when it has mtp_draft_at tokens
        self.mtp_draft: list[int] = []
        self.mtp_draft_at = -1
        # Prompt logprobs so far (params.prompt_logprobs): entry p scores prompt token p + 1.
        self.prompt_lp: list[PromptLogprob] = []

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output without copying the whole sequence."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:end] + self.output_ids[: max(end - n, 0)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def remaining_max_tokens(self) -> int:
        return max(self.params.max_tokens - len(self.output_ids), 0)

    def reset_for_recompute(self) -> None:
        """After preemption: the cache is gone; prompt + output so far are recomputed."""
        self.pages = []
        self.prefix_node = None
        self.num_computed = 0
        self.matched_tokens = 0
        self.resume_from = 0  # what it recomputes, it computes whole
        self.status = Status.WAITING
