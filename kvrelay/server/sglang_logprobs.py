"""SGLang's logprobs on `/generate` (`return_logprob`), in its response shape.

meta_info gets `input_token_logprobs` (prompt positions from `logprob_start_len` on; -1, the
default: none) and `output_token_logprobs`, each entry `[logprob, token_id, text]` (text None
unless `return_text_in_logprobs`); the prompt's first token has logprob None (nothing precedes
it). With `top_logprobs_num` k > 0 also `input_top_logprobs` and `output_top_logprobs`: per
position a list of k `[logprob, token_id, text]` (None for the prompt's first token). Prompt
positions are scored in the prefill's own forward (engine prompt logprobs); a
`logprob_start_len` past the prompt is a 400, as SGLang refuses it."""

from __future__ import annotations

from kvrelay.engine.messages import PromptLogprob, TokenLogprob
from kvrelay.server.prompt_logprobs import FLOOR
from kvrelay.server.prompt_logprobs import first as first_prompt_logprobs

INPUT_KEYS = ("input_token_logprobs", "input_top_logprobs")


def _lp(x: float) -> float:
    return x if x == x and x not in (float("inf"), float("-inf")) else FLOOR


class SGLangLogprobs:
    """Shapes one request's logprobs; `start` is the first prompt position reported."""

    def __init__(self, tokenizer, prompt_ids: list[int], start: int, top: int, text: bool):
        self.tokenizer, self.prompt_ids = tokenizer, prompt_ids
        self.start, self.top, self.text = start, top, text
        self._input: dict | None = None

    @property
    def wants_prompt(self) -> bool:
        return self.start < len(self.prompt_ids)

    def _texts(self, ids: list[int]) -> list[str | None]:
        if not self.text or not ids:
            return [None] * len(ids)
        return self.tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)

    def _entries(self, pairs: list[tuple[float | None, int]]) -> list[list]:
        texts = self._texts([t for _, t in pairs])
        rows = zip(pairs, texts, strict=True)
        return [[None if lp is None else _lp(lp), t, s] for (lp, t), s in rows]

    def _tops(self, rows: list[list[TokenLogprob] | None]) -> list[list | None]:
        return [
            None if r is None else self._entries([(a.logprob, a.token_id) for a in r[: self.top]])
            for r in rows
        ]

    def input_part(self, entries: list[PromptLogprob] | None) -> dict:
        """The prompt's part (computed once: it is the same in every streamed event). None
        entries (a PD decode server, which never runs the prompt): None values, which the
        router replaces with prefill's."""
        if self._input is not None:
            return self._input
        if not self.wants_prompt:
            part: dict = {"input_token_logprobs": []}
            if self.top > 0:
                part["input_top_logprobs"] = []
            self._input = part
            return part
        if entries is None:
            return dict.fromkeys(INPUT_KEYS[: 1 + (self.top > 0)])
        positions = range(self.start, len(self.prompt_ids))
        pairs = [
            (None if p == 0 else entries[p - 1].logprob, self.prompt_ids[p]) for p in positions
        ]
        part = {"input_token_logprobs": self._entries(pairs)}
        if self.top > 0:
            part["input_top_logprobs"] = self._tops(
                [None if p == 0 else entries[p - 1].top for p in positions]
            )
        self._input = part
        return part

    def meta(self, deltas) -> dict:
        """meta_info's logprob fields for the output so far."""
        pairs, tops = [], []
        for d in deltas:
            for i, tok in enumerate(d.token_ids[: len(d.logprobs)]):
                pairs.append((d.logprobs[i], tok))
                tops.append(d.top_logprobs[i] if i < len(d.top_logprobs) else [])
        out = dict(self.input_part(first_prompt_logprobs(deltas)))
        out["output_token_logprobs"] = self._entries(pairs)
        out["output_token_logprobs_length"] = len(pairs)
        if self.top > 0:
            out["output_top_logprobs"] = self._tops(tops)
        return out
