"""Build OpenAI response bodies (whole and streamed) from generation deltas."""

from __future__ import annotations

from kvrelay.server.generation import Delta


def token_text(tokenizer, token_id: int, as_id: bool = False) -> str:
    """A token as logprobs show it: its text, or vLLM's "token_id:<id>" (`as_id`, the
    request's return_tokens_as_token_ids)."""
    if as_id:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer, deltas: list[Delta], as_ids: bool = False) -> dict:
    content = []
    for d in deltas:
        for i, tok in enumerate(d.token_ids):
            if i >= len(d.logprobs):
                break
            text = token_text(tokenizer, tok, as_ids)
            content.append(
                {
                    "token": text,
                    "logprob": d.logprobs[i],
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {
                            "token": (t := token_text(tokenizer, a.token_id, as_ids)),
                            "logprob": a.logprob,
                            "bytes": list(t.encode()),
                        }
                        for a in (d.top_logprobs[i] if i < len(d.top_logprobs) else [])
                    ],
                }
            )
    return {"content": content}


def completion_logprobs(
    tokenizer, deltas: list[Delta], offset: int = 0, as_ids: bool = False
) -> dict:
    """Offsets stay those of the text (a token shown as its id still spans its text)."""
    tokens, lps, tops, offsets = [], [], [], []
    pos = offset
    for d in deltas:
        for i, tok in enumerate(d.token_ids):
            if i >= len(d.logprobs):
                break
            text = token_text(tokenizer, tok)
            tokens.append(token_text(tokenizer, tok, True) if as_ids else text)
            lps.append(d.logprobs[i])
            offsets.append(pos)
            pos += len(text)
            top = d.top_logprobs[i] if i < len(d.top_logprobs) else []
            tops.append({token_text(tokenizer, a.token_id, as_ids): a.logprob for a in top})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens served from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
