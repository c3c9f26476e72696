"""Grammar-constrained decoding in the engine process: llguidance matchers and the step's bitmask.

A request whose SamplingParams carry a `grammar` (llguidance's serialized grammar text, built and
validated by the API process: kvrelay/server/structured.py) gets an LLMatcher here. Each step,
`StepBitmask.build` fills one int32 bitmask [batch, ceil(vocab/32)] for the whole sampling batch:
rows of constrained requests from their matchers (llguidance's executor, in parallel, no Python
loop over the vocabulary), every other row all ones (-1), so unconstrained rows are unchanged.
The sampler applies it with torch ops (sampler.apply_token_bitmask). After sampling, each matcher
consumes its token; a grammar that is complete finishes the request.

llguidance rather than xgrammar: llguidance has no Python dependencies (one abi3 wheel), while
xgrammar pulls transformers, triton and tvm-ffi; vLLM and SGLang use both.

Compiled grammars are cached (LRU, keyed by the grammar text's digest; a backend has one
tokenizer): a request gets a copy of the cached matcher. The llguidance tokenizer is built from the model's HF tokenizer the
first time a constrained request arrives (about a second, once), not at engine start.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict

import torch

from kvrelay.engine.request import Request

log = logging.getLogger("kvrelay.engine")

CACHE_SIZE = 64  # compiled grammars kept (an agent's tool set is one grammar, reused every turn)


class GrammarError(ValueError):
    """A grammar llguidance cannot compile (the API validates first, so this is rare)."""


class GrammarBackend:
    """The llguidance tokenizer of one model, its compiled-grammar cache and its executor."""

    def __init__(self, src, vocab_size: int, eos_ids: list[int]) -> None:
        self.src = src  # ModelSource: where the tokenizer is
        self.vocab_size = vocab_size  # the logits' width
        self.eos_ids = list(eos_ids)
        self._tokenizer = None
        self._executor = None
        self._cache: OrderedDict[bytes, object] = OrderedDict()
        self.hits = self.misses = 0

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            import llguidance
            import llguidance.hf

            # The same HF tokenizer the API process loads (weights/tokenizer.py).
            from kvrelay.weights.tokenizer import load_tokenizer

            t0 = time.perf_counter()
            hf = load_tokenizer(self.src)
            self._tokenizer = llguidance.hf.from_tokenizer(
                hf, n_vocab=max(self.vocab_size, len(hf)), eos_token=self.eos_ids or None
            )
            self._executor = llguidance.LLExecutor()
            log.info(
                "grammar tokenizer built vocab=%d eos=%s seconds=%.2f",
                self._tokenizer.vocab_size,
                self.eos_ids,
                time.perf_counter() - t0,
            )
        return self._tokenizer

    def matcher(self, grammar: str):
        """A fresh matcher for `grammar` (compiled once, then copied from the cache)."""
        import llguidance

        tok = self.tokenizer
        # This backend has one tokenizer: the key is the grammar's digest (big schemas stay out).
        key = hashlib.sha256(grammar.encode()).digest()
        template = self._cache.get(key)
        if template is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return template.deep_copy()
        self.misses += 1
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(f"the grammar does not compile: {m.get_error()}")
        self._cache[key] = m
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return m.deep_copy()

    def mask_width(self) -> int:
        return (self.tokenizer.vocab_size + 31) // 32

    def bitmask(self, reqs: list[Request]) -> torch.Tensor | None:
        """The step's bitmask for these sampling rows (None when none is constrained). A
        matcher first consumes output tokens it has not seen (a PD decode side gets its first
        token from the prefill side, not from this sampler)."""
        rows = [(r.matcher, i) for i, r in enumerate(reqs) if r.matcher is not None]
        if not rows:
            return None
        for r in reqs:
            if r.matcher is not None:
                catch_up(r)
        width = self.mask_width()
        mask = torch.full((len(reqs), width), -1, dtype=torch.int32)  # CPU, contiguous
        # llguidance.torch.fill_next_token_bitmask_par without importing that module (it
        # decorates a kernel with torch.compile at import): the executor fills the rows in
        # parallel threads, straight into the tensor's memory.
        self._executor.unsafe_compute_mask_ptr(rows, mask.data_ptr(), width * 4, len(reqs))
        return mask


def catch_up(req: Request) -> None:
    """Feed the matcher the output tokens it has not consumed yet."""
    todo = req.output_ids[req.grammar_consumed :]
    if todo:
        req.matcher.consume_tokens(todo)
        req.grammar_consumed = len(req.output_ids)


def advance(req: Request, token: int) -> str | None:
    """After `token` was appended to req's output: the matcher consumes it. Returns "stop" when
    the grammar is complete (nothing but EOS may follow), "error" with the matcher's error when
    the token broke it, None otherwise."""
    m = req.matcher
    ok = m.consume_token(token)
    req.grammar_consumed = len(req.output_ids)
    if not ok or m.is_error():
        return "error"
    return "stop" if m.is_stopped() else None
