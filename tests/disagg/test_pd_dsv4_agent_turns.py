"""Two-turn chats with the tiny DeepSeek-V4 agent (shared/models/dsv4-tiny-agent, CPU float32)
through a real PD stack (router + prefill + decode processes) and a single server: equal token
for token at concurrency 1 and 8, and turn 2 moves only what decode's own prefix cache lacks.

The system prompt makes turn 1 ~170 tokens, past one 128-token page (the page size: a multiple
of the ratio-4 and ratio-128 compressors) and its 64-token sliding window: decode caches that
page (compressed KV, index keys, the compressor state at its end, and its window rows from 65
on: what a hit at 128 reads) and turn 2 resumes from it. The bytes are counted from the
model's shape, not from the code that sends them.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import ServerProcess
from conversations import two_turns
from pd_stack import PDStack, engine_threads

from kvrelay.models.deepseek_v4.cache_spec import dsv4_cache_spec, dsv4_page_size
from kvrelay.models.deepseek_v4.config import CSA, SLIDING
from kvrelay.weights.loader import resolve

AGENT = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "dsv4-tiny-agent"
pytestmark = pytest.mark.skipif(
    not (AGENT / "config.json").is_file(),
    reason=f"the tiny DeepSeek-V4 agent is not at {AGENT} (a checkout without ../shared)",
)
MODEL = "dsv4-tiny-agent"
PAGE = 128
SERVE = ("--model", str(AGENT), "--device", "cpu", "--dtype", "float32")
SYSTEM = (
    "You are the lighthouse keeper's assistant. You answer in one short sentence, you never "
    "make up facts, and you always mention the weather if it is known. "
) * 4


@pytest.fixture(scope="module")
def stacks():
    with engine_threads(), ThreadPoolExecutor(2) as ex:  # all four start in parallel
        fs = ex.submit(ServerProcess, *SERVE, "--max-total-tokens", "8192")
        fp = ex.submit(PDStack, max_total_tokens=8192, model=SERVE)
    try:
        yield fs.result(), fp.result()
    finally:
        for f in (fs, fp):
            if f.exception() is None:
                f.result().close()


def _window_from(c, hit: int, n: int) -> int:
    """The first token whose window row travels to a caching decode that holds `hit`: the
    window - 1 tokens before the prompt's last full page boundary (what a hit ending there
    reads) and all after them (the prompt's last window - 1 among them)."""
    boundary = n // PAGE * PAGE
    return max(hit, (boundary or n) - (c.sliding_window - 1), 0)


def _sent_bytes(hit: int, n: int) -> int:
    """KV bytes a transfer of tokens [hit, n) moves when decode caches the prompt (fp32): the
    window rows from `_window_from` on, the compressed rows and index keys of the windows
    completed after `hit`, the compressor state at the prompt's last full page end (unless
    decode holds that page), and the state slot."""
    c, f32 = resolve(str(AGENT)).config, 4
    d, di = c.head_dim, c.index_head_dim
    total = 0
    for i, kind in enumerate(c.layer_types):
        total += (n - _window_from(c, hit, n)) * d
        if kind != SLIDING:
            r = c.compress_ratio(i)
            total += (n // r - hit // r) * d
        if kind == CSA:
            r = c.csa_compress_ratio
            total += (n // r - hit // r) * di
            total += (hit < n // PAGE * PAGE) * 2 * r * (d + di)  # page end: kv + score
    return total * f32 + dsv4_cache_spec(c, dsv4_page_size(c, 1), torch.float32).bytes_per_slot


@pytest.mark.parametrize("n", [1, 8])
def test_second_turn_moves_only_what_decode_does_not_hold(stacks, n: int) -> None:
    single, pd = stacks
    first, got, moved = two_turns(pd, single.url, n, MODEL, SYSTEM)
    assert all(f["prompt_n"] > PAGE for f in first)
    for f, g in zip(first, got, strict=True):
        # decode computed turn 1's prompt and 3 answer tokens: its full pages are a hit
        assert g["cached"] == min((f["prompt_n"] + 3) // PAGE, (g["prompt_n"] - 1) // PAGE) * PAGE
    assert moved["hits"] == sum(g["cached"] for g in got) >= n * PAGE
    assert moved["bytes"] == sum(_sent_bytes(g["cached"], g["prompt_n"]) for g in got)
    with open(pd.decode.log_path) as f:
        assert "prefix_cache=on" in f.read()
