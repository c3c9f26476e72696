"""A GGUF model's tokenizer converted once and loaded from disk afterwards encodes, decodes and
renders the chat template exactly as the fresh conversion does."""

from __future__ import annotations

from kvrelay.weights.loader import resolve
from kvrelay.weights.tokenizer_cache import gguf_tokenizer

TEXTS = [
    "What is the capital of France?",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "ünïcödé — 漢字 🚀 emoji and ZWJ 👩‍💻",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "x" * 300,
]


def test_cached_tokenizer_equals_the_fresh_conversion(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))
    src = resolve("smollm2")
    fresh = gguf_tokenizer(src.tokenizer_dir, src.tokenizer_gguf)  # converts, writes the entry
    entries = list((tmp_path / "tokenizers").iterdir())
    assert len(entries) == 1 and (entries[0] / "tokenizer.json").is_file()
    assert not [p for p in (tmp_path / "tokenizers").iterdir() if p.name.startswith(".tmp-")]
    cached = gguf_tokenizer(src.tokenizer_dir, src.tokenizer_gguf)
    assert cached.name_or_path == str(entries[0])  # really read from the entry
    assert type(cached) is type(fresh)  # the class AutoTokenizer picks, loaded without it

    for text in TEXTS:
        ids = fresh.encode(text)
        assert cached.encode(text) == ids, text
        assert cached.decode(ids) == fresh.decode(ids)
        assert cached.decode(ids, skip_special_tokens=True) == fresh.decode(
            ids, skip_special_tokens=True
        )
    assert cached.get_vocab() == fresh.get_vocab()
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token", "all_special_tokens"):
        assert getattr(cached, attr) == getattr(fresh, attr), attr
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[2]}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for kw in ({}, {"tools": tools}):
        assert cached.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **kw
        ) == fresh.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)


def test_a_changed_model_file_is_a_new_entry_and_off_writes_nothing(tmp_path, monkeypatch):
    from kvrelay.weights import tokenizer_cache

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF one")
    monkeypatch.setenv("KVRELAY_CACHE_DIR", "off")
    assert tokenizer_cache._entry(str(gguf)) is None
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "cache"))
    before = tokenizer_cache._entry(str(gguf))
    assert before == tokenizer_cache._entry(str(gguf))
    gguf.write_bytes(b"GGUF two, longer")  # another size (and mtime): another entry
    assert tokenizer_cache._entry(str(gguf)) != before
