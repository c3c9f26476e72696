"""The chat template applied with the model's tokenizer (loaded by weights/tokenizer.py), and an
incremental detokenizer."""

from __future__ import annotations


def apply_chat_template(
    tokenizer,
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[int]:
    """`continue_final_message`: the last message left open (no end-of-turn), to be continued."""
    if not tokenizer.chat_template:
        raise ValueError("this model has no chat template; use /v1/completions")
    out = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tokenize=True,
    )
    return list(out["input_ids"] if hasattr(out, "keys") else out)


class IncrementalDetokenizer:
    """Emits text as tokens arrive, holding back bytes of an unfinished UTF-8 character.

    Decodes a small window (a few tokens before the unread ones) rather than the whole output,
    so each step costs O(1) regardless of output length.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(
            ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False
        )

    def add(self, token_ids: list[int]) -> str:
        self.ids += token_ids
        return self._advance(flush=False)

    def flush(self) -> str:
        """At the end of a request: whatever was held back, even an incomplete character."""
        return self._advance(flush=True)

    def _advance(self, flush: bool) -> str:
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if not flush and (len(full) <= len(prefix) or full.endswith("\ufffd")):
            return ""  # nothing new yet, or a UTF-8 character is still incomplete
        if flush:
            self.prefix_offset = self.read_offset = len(self.ids)
        else:
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]
