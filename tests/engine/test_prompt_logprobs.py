"""Prompt logprobs scored in the prefill equal a float32 full forward over the prompt.

SmolLM2 (the embedded GGUF) against HF transformers' LlamaForCausalLM holding the same weights
(an independent implementation, every position's logits in one pass); DeepSeek-V4 (dsv4-tiny)
against its own full-sequence forward. Prefill in small chunks, beside requests that do not ask
(their outputs unchanged), with max_tokens 0, and recomputed after a preemption.
"""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
import torch

from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams
from kvrelay.engine.scheduler import Scheduler
from kvrelay.weights.loader import resolve

TOL = 1e-4
K = 3
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def smollm2() -> Engine:
    cfg = EngineConfig(
        model="smollm2",
        device="cpu",
        dtype="float32",
        cache=CacheConfig(max_total_tokens=2048),
        scheduler=SchedulerConfig(max_num_batched_tokens=16),  # prompts prefill in chunks
    )
    return Engine(cfg)


@pytest.fixture(scope="module")
def hf_model(smollm2: Engine):
    """HF's Llama on the engine's own (dequantized) weights, float32."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    c = smollm2.src.config
    hc = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
    )
    with torch.device("meta"):  # no random init of 135M parameters: the weights are assigned
        model = transformers.LlamaForCausalLM(hc)
    weights = {k: v.clone() for k, v in smollm2.runner.model.hf_state_dict().items()}
    model.load_state_dict(weights, strict=False, assign=True)
    model.tie_weights()
    model.model.rotary_emb = LlamaRotaryEmbedding(config=hc)  # its buffer, built on the CPU
    return model.eval()


def _reference(logits: torch.Tensor, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-softmax rows [n-1, V] that score prompt tokens 1..n-1, those tokens' logprobs) from
    the full forward's logits [n, V]."""
    lp = torch.log_softmax(logits.float(), -1)[:-1]
    return lp, lp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def _check(entries, ref, k: int = K) -> None:
    """Logprobs within TOL; ranks and top-k as the reference has them, up to ties within TOL."""
    lp, chosen = ref
    assert len(entries) == len(chosen)
    got = torch.tensor([e.logprob for e in entries])
    assert (got - chosen).abs().max().item() < TOL
    ranks = torch.tensor([e.rank for e in entries])
    assert ((lp > chosen[:, None] + TOL).sum(1) < ranks).all()
    assert (ranks <= (lp >= chosen[:, None] - TOL).sum(1)).all()
    top_v = lp.topk(k, dim=1).values
    for row, e, tv in zip(lp, entries, top_v.tolist(), strict=True):
        assert len(e.top) == k
        assert max(abs(a.logprob - v) for a, v in zip(e.top, tv, strict=True)) < TOL
        assert max(abs(a.logprob - row[a.token_id].item()) for a in e.top) < TOL


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_smollm2_chunked_prefill_matches_hf_beside_plain_requests(
    smollm2: Engine, hf_model
) -> None:
    vocab = smollm2.src.config.vocab_size
    scored = _ids(40, 1, vocab)  # three 16-token chunks
    plain = _ids(12, 2, vocab)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1)
    alone = generate(smollm2, [plain], greedy)[0]
    with_scores = msgspec.structs.replace(greedy, prompt_logprobs=K)
    only_scores = SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=K)
    outs = generate(
        smollm2, [scored, plain, scored], [with_scores, greedy, only_scores]
    )  # one continuous batch: chunks of the scored prompts share steps with the plain one
    with torch.no_grad():
        ref = _reference(hf_model(torch.tensor([scored])).logits[0], scored)
    # The plain request is untouched: same tokens and logprobs as alone, no prompt logprobs.
    assert [o.token_ids for o in outs[1]] == [o.token_ids for o in alone]
    got_lp = [x for o in outs[1] for x in o.logprobs]
    assert got_lp == pytest.approx([x for o in alone for x in o.logprobs], abs=TOL)
    assert all(o.prompt_logprobs is None for o in outs[1])
    # Scored and generating: the prompt's entries come once, with the first token.
    first, *rest = outs[0]
    _check(first.prompt_logprobs, ref)
    assert first.token_ids and all(o.prompt_logprobs is None for o in rest)
    assert sum(len(o.token_ids) for o in outs[0]) == 4
    # max_tokens 0: the prompt's entries alone, finish "length", nothing generated.
    (only,) = outs[2]
    assert only.token_ids == [] and only.finish_reason == "length"
    _check(only.prompt_logprobs, ref)
    smollm2.check_idle_integrity()


def test_cached_prompt_is_scored_again(smollm2: Engine, hf_model) -> None:
    """A prompt the prefix cache holds (a plain request ran it first) is still scored at every
    position: requests that want prompt logprobs do not take cached pages."""
    vocab = smollm2.src.config.vocab_size
    prompt = _ids(40, 3, vocab)
    generate(smollm2, [prompt], SamplingParams(max_tokens=2, temperature=0.0))
    (only,) = generate(
        smollm2, [prompt], SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=K)
    )[0]
    with torch.no_grad():
        ref = _reference(hf_model(torch.tensor([prompt])).logits[0], prompt)
    _check(only.prompt_logprobs, ref)
    assert only.num_cached_tokens == 0


def test_one_token_prompt_has_no_entries(smollm2: Engine) -> None:
    (out,) = generate(
        smollm2, [[42]], SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=0)
    )[0]
    assert out.prompt_logprobs == [] and out.finish_reason == "length"


def _dsv4(max_tokens: int, budget: int) -> Engine:
    src = resolve("dsv4-tiny", "dummy")
    src = dataclasses.replace(src, config=src.config.with_(qat_simulation=False))
    cfg = EngineConfig(
        model="dsv4-tiny",
        load_format="dummy",
        device="cpu",
        dtype="float32",
        cache=CacheConfig(max_total_tokens=max_tokens),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, kv_reserve_ratio=0.0),
    )
    return Engine(cfg, src)


def test_dsv4_chunked_and_preempted_match_full_forward(monkeypatch) -> None:
    # 12 usable pages of 16 tokens: while two short requests decode and grow, the 100-token
    # prompt (16-token chunks) is preempted mid-prefill and recomputed; its entries must not be
    # scored twice or lost.
    eng = _dsv4(max_tokens=192, budget=16)
    victims = []
    preempt = Scheduler._preempt_newest

    def spy(self):
        v = preempt(self)
        victims.append((len(v.prompt_lp), len(v.output_ids)))
        return v

    monkeypatch.setattr(Scheduler, "_preempt_newest", spy)
    vocab = eng.src.config.vocab_size
    prompts = [_ids(n, 5 + i, vocab) for i, n in enumerate((30, 30, 100))]
    p = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, prompt_logprobs=K)
    plain = msgspec.structs.replace(p, prompt_logprobs=None)
    outs = generate(eng, prompts, [plain, p, p])
    assert any(0 < lp < 99 and out == 0 for lp, out in victims), victims  # mid-prefill
    for i in (1, 2):
        ref = _reference(eng.runner.model(torch.tensor(prompts[i])), prompts[i])
        _check(outs[i][0].prompt_logprobs, ref)
        assert all(o.prompt_logprobs is None for o in outs[i][1:])
    assert all(o.prompt_logprobs is None for o in outs[0])
    alone = generate(eng, [prompts[0]], plain)[0]
    assert [t for o in outs[0] for t in o.token_ids] == [t for o in alone for t in o.token_ids]
    eng.check_idle_integrity()
