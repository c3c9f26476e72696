"""A KV pool too small for the batch forces preemption (recompute); outputs stay identical."""

from __future__ import annotations

from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams

PARAMS = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def _prompts(tokenizer) -> list[list[int]]:
    topics = ["cats", "the moon", "bread", "rivers", "chess", "rain", "glass", "owls"]
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Tell me about {t}."}],
                add_generation_prompt=True,
                tokenize=True,
            )["input_ids"]
        )
        for t in topics
    ]


def _tokens(outs) -> list[list[int]]:
    return [[t for o in out for t in o.token_ids] for out in outs]


def test_preempted_requests_give_the_same_tokens(smollm2_tokenizer):
    prompts = _prompts(smollm2_tokenizer)
    roomy = Engine(EngineConfig(cache=CacheConfig(max_total_tokens=8192)))
    want = _tokens(generate(roomy, prompts, PARAMS))
    assert roomy.scheduler.num_preemptions == 0

    # 8 requests x (~40 prompt + 48 new) tokens need ~700 slots; give them 448, reserve nothing.
    tight = Engine(
        EngineConfig(
            cache=CacheConfig(max_total_tokens=448, page_size=16),
            scheduler=SchedulerConfig(kv_reserve_ratio=0.0),
        )
    )
    got = _tokens(generate(tight, prompts, PARAMS))
    assert tight.scheduler.num_preemptions > 0
    assert got == want
    tight.check_idle_integrity()
    tight.flush_prefix_cache()  # what the prefix cache alone holds
    assert tight.scheduler.page_pool.num_used == 0


def test_full_reservation_never_preempts(smollm2_tokenizer):
    prompts = _prompts(smollm2_tokenizer)
    eng = Engine(EngineConfig(cache=CacheConfig(max_total_tokens=448, page_size=16)))
    outs = generate(eng, prompts, PARAMS)
    assert eng.scheduler.num_preemptions == 0  # admission waited instead
    assert all(len(t) == 48 for t in _tokens(outs))
