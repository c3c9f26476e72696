"""The official openai client against a server or router: one request spec -> comparable result."""

from __future__ import annotations

import openai


def run_spec(client: openai.OpenAI, model: str, spec: dict) -> dict:
    """Run one spec (completion or chat, streaming or not) and collect text, finish, usage and
    logprobs the same way for both."""
    kw = dict(model=model, max_tokens=spec["max_tokens"], temperature=0)
    stream = spec["stream"]
    if stream:
        kw.update(stream=True, stream_options={"include_usage": True})
    if spec["kind"] == "completion":
        if spec["logprobs"] is not None:
            kw["logprobs"] = spec["logprobs"]
        r = client.completions.create(prompt=spec["prompt"], **kw)
        if not stream:
            c = r.choices[0]
            lps = c.logprobs.token_logprobs if c.logprobs else None
            return {
                "text": c.text,
                "finish": c.finish_reason,
                "n": r.usage.completion_tokens,
                "prompt_n": r.usage.prompt_tokens,
                "lps": lps,
            }
        text, lps, finish, n, prompt_n = "", [], None, None, None
        for ch in r:
            if ch.usage:
                n, prompt_n = ch.usage.completion_tokens, ch.usage.prompt_tokens
            for c in ch.choices:
                text += c.text
                finish = c.finish_reason or finish
                if c.logprobs:
                    lps += c.logprobs.token_logprobs
        return {"text": text, "finish": finish, "n": n, "prompt_n": prompt_n, "lps": lps or None}
    if spec["logprobs"]:
        kw.update(logprobs=True, top_logprobs=2)
    r = client.chat.completions.create(
        messages=[{"role": "user", "content": spec["content"]}], **kw
    )
    if not stream:
        c = r.choices[0]
        lps = [x.logprob for x in c.logprobs.content] if c.logprobs else None
        return {
            "text": c.message.content,
            "finish": c.finish_reason,
            "n": r.usage.completion_tokens,
            "prompt_n": r.usage.prompt_tokens,
            "lps": lps,
        }
    text, lps, finish, n, prompt_n = "", [], None, None, None
    for ch in r:
        if ch.usage:
            n, prompt_n = ch.usage.completion_tokens, ch.usage.prompt_tokens
        for c in ch.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
            if c.logprobs and c.logprobs.content:
                lps += [x.logprob for x in c.logprobs.content]
    return {"text": text, "finish": finish, "n": n, "prompt_n": prompt_n, "lps": lps or None}


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
