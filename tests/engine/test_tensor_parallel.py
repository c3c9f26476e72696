"""Tensor parallel (dense models) with gloo on CPU: TP=2 == TP=1 on the same dummy weights.

Rank 0 runs the real engine (scheduler, runner, sampler) and broadcasts each step's batch; rank 1
builds only its runner and follows. Both ranks hold half the heads, half the MLP and half the
vocabulary, and half the KV heads in their paged caches.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import socket

import msgspec
import pytest
import torch
import torch.distributed
from conftest import end_rank

from kvrelay.config import CacheConfig, EngineConfig
from kvrelay.disagg.pieces import gather, piece_rows
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams
from kvrelay.engine.request import Request
from kvrelay.engine.scheduler import ScheduledRequest
from kvrelay.layers.parallel import TPGroup
from kvrelay.models import registry
from kvrelay.models.llama.model import LlamaForCausalLM
from kvrelay.weights.loader import ModelSource

PROMPTS = [[5, 17, 301, 42, 7], [1000, 2000, 3000], [9] * 11]
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

# A Qwen2-style model: q/k/v bias and tied embeddings, an odd vocabulary (padded per rank).
QWEN2_TINY = dataclasses.replace(
    registry.preset("qwen3-tiny")[1],
    architecture="Qwen2ForCausalLM",
    vocab_size=3001,
    qk_norm=False,
    attention_bias=True,
    tie_word_embeddings=True,
)


def _source(name: str) -> ModelSource:
    if name == "qwen2-tiny":
        return ModelSource(name, "dummy", None, QWEN2_TINY, "", None)
    return ModelSource(name, "dummy", None, registry.preset(name)[1], "", None)


def _config(tp: int) -> EngineConfig:
    return EngineConfig(
        load_format="dummy",
        dtype="float32",
        device="cpu",
        tensor_parallel_size=tp,
        cache=CacheConfig(max_total_tokens=1024),
    )


def _pages(engine: Engine) -> list[list[int]]:
    """Each prompt's KV pages in `_prefill_logits` (from page 1 on)."""
    out, page = [], 1
    for ids in PROMPTS:
        n = -(-len(ids) // engine.runner.page_size)
        out.append(list(range(page, page + n)))
        page += n
    return out


def _prefill_logits(engine: Engine) -> torch.Tensor:
    """Logits of one prefill batch of every prompt, straight through the runner."""
    batch = []
    for i, (ids, pages) in enumerate(zip(PROMPTS, _pages(engine), strict=True)):
        req = Request(f"p{i}", ids, PARAMS, i)
        req.pages = pages
        batch.append(ScheduledRequest(req, len(ids)))
    return engine.runner.forward(batch)


def _sent_rows(engine: Engine) -> torch.Tensor:
    """What a PD prefill would send of each prompt's KV after `_prefill_logits`, as floats
    [prompt tokens, cache kinds, whole row]: TP=1 reads its pool; TP=2 gathers every rank's KV
    heads to rank 0 (engine/tp_gather.py)."""
    runner = engine.runner
    kinds, out = runner.transfer_layout(), []
    for ids, pages in zip(PROMPTS, _pages(engine), strict=True):
        n = len(ids)
        if runner.tp.is_parallel:
            buf = runner.gather_piece(kinds, pages, 0, 0, n, n, False)
        else:
            buf = gather(kinds, piece_rows(kinds, pages, 0, runner.page_size, 0, n, n, False))
        rows = torch.frombuffer(bytearray(buf), dtype=torch.float32)
        out.append(rows.view(len(kinds), n, -1).transpose(0, 1))
    return torch.cat(out)


def _run(engine: Engine) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    logits = _prefill_logits(engine)
    kv = _sent_rows(engine)  # before generate() reuses the pages
    outs = generate(engine, PROMPTS, PARAMS)
    return logits, kv, [[t for o in out for t in o.token_ids] for out in outs]


def _rank(rank: int, port: int, name: str, results) -> None:
    torch.set_num_threads(1)
    from kvrelay.engine.tp_worker import follower_main, init_distributed

    cfg, src = _config(2), _source(name)
    if rank > 0:
        follower_main(cfg, rank, "127.0.0.1", port, src)
        return
    init_distributed(0, 2, "127.0.0.1", port, "cpu")
    engine = Engine(cfg, src)
    try:
        logits, kv, tokens = _run(engine)
        rejected = generate(engine, [[1, 2, 3]], msgspec.structs.replace(PARAMS, prompt_logprobs=1))
        assert rejected[0][0].finish_reason == "rejected", rejected  # not a failed step
        results.put((logits.numpy(), kv.numpy(), tokens))  # numpy: not shared memory
    finally:
        engine.runner.stop_followers()
        torch.distributed.destroy_process_group()
    end_rank(results)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen2-tiny"])
def test_tp2_matches_tp1_greedy_and_logits(name):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, name, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        logits, kv, tokens = results.get(timeout=80)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]

    torch.set_num_threads(1)
    want_logits, want_kv, want_tokens = _run(Engine(_config(1), _source(name)))
    logits = torch.from_numpy(logits)
    assert logits.shape == want_logits.shape
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
    assert tokens == want_tokens
    # The rows a TP=2 PD prefill sends (every rank's KV heads gathered to rank 0) are TP=1's.
    # Layer 0's K and V come from the embedding (an exact masked sum) and this rank's slice of
    # the same qkv dot products: bitwise. Later layers read hidden states that went through
    # row-parallel all-reduces (partial sums added in another order): equal within 1e-5.
    kv = torch.from_numpy(kv)
    assert kv.shape == want_kv.shape
    assert torch.equal(kv[:, :2], want_kv[:, :2])
    torch.testing.assert_close(kv, want_kv, atol=1e-5, rtol=1e-5)


def test_kv_heads_must_divide_by_tp():
    cfg = dataclasses.replace(registry.preset("qwen3-tiny")[1], num_heads=6, num_kv_heads=3)
    with (
        torch.device("meta"),
        pytest.raises(ValueError, match="num_kv_heads .3. must be divisible"),
    ):
        LlamaForCausalLM(cfg, TPGroup(0, 2))


def test_rank_holds_its_slices():
    cfg = registry.preset("qwen3-tiny")[1]
    with torch.device("meta"):
        full, half = LlamaForCausalLM(cfg), LlamaForCausalLM(cfg, TPGroup(1, 2))
    attn = half.model.layers[0].self_attn
    assert (
        attn.qkv_proj.weight.shape[0] * 2 == full.model.layers[0].self_attn.qkv_proj.weight.shape[0]
    )
    assert attn.o_proj.weight.shape == (cfg.hidden_size, cfg.num_heads // 2 * cfg.head_dim)
    assert half.model.embed_tokens.weight.shape[0] == cfg.vocab_size // 2
    # The fused gate_up of rank 1 is [gate rows of rank 1; up rows of rank 1].
    w = torch.arange(2 * cfg.intermediate_size, dtype=torch.float32)[:, None]
    gate = half.shard_tensor("model.layers.0.mlp.gate_proj.weight", w[: cfg.intermediate_size])
    up = half.shard_tensor("model.layers.0.mlp.up_proj.weight", w[cfg.intermediate_size :])
    i2 = cfg.intermediate_size // 2
    assert gate[0, 0] == i2 and up[0, 0] == cfg.intermediate_size + i2


def test_served_tp2_matches_tp1():
    """`kvrelay serve --tensor-parallel-size 2` (two engine ranks over gloo) answers greedy
    completions exactly as one rank does (both servers start side by side)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from conftest import ServerProcess

    args = ("--model", "qwen3-tiny", "--load-format", "dummy", "--dtype", "float32")
    args += ("--device", "cpu", "--max-total-tokens", "1024")
    with ThreadPoolExecutor(2) as pool:
        starts = [
            pool.submit(ServerProcess, *args, "--tensor-parallel-size", str(tp)) for tp in (1, 2)
        ]
    servers = [f.result() for f in starts if f.exception() is None]
    try:
        assert len(servers) == 2, [f.exception() for f in starts]
        texts = [
            [
                httpx.post(
                    s.url + "/v1/completions",
                    json={
                        "model": "qwen3-tiny",
                        "prompt": prompt,
                        "max_tokens": 16,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                    timeout=60,
                ).json()["choices"][0]["text"]
                for prompt in ("Hello there", "The capital of France is", "1 2 3 4")
            ]
            for s in servers
        ]
    finally:
        for s in servers:
            s.close()
    assert texts[0] == texts[1]
    assert all(texts[0])


def test_safetensors_ranks_read_only_their_slices(tmp_path):
    """Reading each rank's slices from the file gives the same weights as cutting full ones, and
    a rank reads exactly half of every split tensor (the vocabulary: its rows) and all of the
    norms."""
    from counting_reader import CountingReader
    from safetensors.torch import save_file

    from kvrelay.weights import hf_dir
    from kvrelay.weights.loader import _init_dummy

    full = LlamaForCausalLM(QWEN2_TINY)
    _init_dummy(full, 0)
    save_file(
        {k: v.contiguous() for k, v in full.hf_state_dict().items()}, tmp_path / "m.safetensors"
    )
    for rank in range(2):
        sliced, cut = (LlamaForCausalLM(QWEN2_TINY, TPGroup(rank, 2)) for _ in range(2))
        reader = CountingReader()
        sliced.load_weights(
            hf_dir.read_weights(tmp_path, sliced.shard_range, reader), presharded=True
        )
        cut.load_weights(hf_dir.read_weights(tmp_path))
        for name, t in full.hf_state_dict().items():
            whole = t.numel() * t.element_size()
            r = sliced.shard_range(name, t.shape)
            want = whole if r is None else whole // t.shape[r[0]] * (r[2] - r[1])
            assert reader.bytes[name] == want, name
            if r is not None and "embed" not in name:
                assert want * 2 == whole, name
        for (name, a), b in zip(sliced.named_parameters(), cut.parameters(), strict=True):
            assert torch.equal(a, b), name
        rows = -(-QWEN2_TINY.vocab_size // 2)
        assert torch.equal(
            sliced.model.embed_tokens.weight[: QWEN2_TINY.vocab_size - rank * rows],
            full.model.embed_tokens.weight[rank * rows : (rank + 1) * rows],
        )
