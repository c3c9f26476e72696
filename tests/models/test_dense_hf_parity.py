"""Dense models loaded from a sharded HF directory match HF transformers on the same weights.

Each case builds a tiny randomly initialised HF model (float32), saves it as a sharded safetensors
checkpoint with an index, loads the directory into the in-process Engine, and compares greedy
tokens (against HF `generate`) and the chosen tokens' logprobs (against HF's log_softmax).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams

transformers = pytest.importorskip("transformers")

VOCAB = 256
NEW_TOKENS = 16
PROMPT_LENS = (1, 5, 12, 23)
_DIMS = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,  # peakier logits than the default 0.02: robust greedy margins
)
# llama3 scaling with head_dim 16 and theta 1e4: the wavelengths fall into all three bands
# (high-frequency kept, middle smoothed, low-frequency divided by `factor`).
_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 10000.0,
}


def _hf_config(case: str):
    if case == "llama3-untied":
        return transformers.LlamaConfig(**_DIMS, rope_parameters=_LLAMA3, tie_word_embeddings=False)
    if case.startswith("qwen2"):
        return transformers.Qwen2Config(**_DIMS, tie_word_embeddings=case == "qwen2-tied")
    if case.startswith("qwen3"):
        # head_dim * heads != hidden: catches a model that derives head_dim from hidden_size.
        return transformers.Qwen3Config(
            **_DIMS, head_dim=32, tie_word_embeddings=case == "qwen3-tied"
        )
    raise ValueError(case)


CASES = ["llama3-untied", "qwen2-tied", "qwen2-untied", "qwen3-untied", "qwen3-tied"]


def _randomise_defaults(model: torch.nn.Module, gen: torch.Generator) -> None:
    """HF inits biases to 0 and norms to 1; randomise them so that their loading is tested."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))


class Run:
    def __init__(self, case, hf, prompts, tokens, logprobs, ckpt):
        self.case, self.hf, self.prompts = case, hf, prompts
        self.tokens, self.logprobs, self.ckpt = tokens, logprobs, ckpt


@pytest.fixture(scope="module", params=CASES)
def run(request, tmp_path_factory) -> Run:
    case = request.param
    torch.manual_seed(1234)
    gen = torch.Generator().manual_seed(99)
    cfg = _hf_config(case)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    _randomise_defaults(hf, gen)
    ckpt = str(tmp_path_factory.mktemp(case))
    hf.save_pretrained(ckpt, max_shard_size="40KB")

    engine = Engine(
        EngineConfig(
            model=ckpt,
            dtype="float32",
            device="cpu",
            cuda_graphs=False,
            cache=CacheConfig(page_size=4, max_total_tokens=512),
            # A small budget: the longer prompts are prefilled in several chunks.
            scheduler=SchedulerConfig(max_num_batched_tokens=16),
        )
    )
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = generate(engine, prompts, params)
    tokens = [[t for o in out for t in o.token_ids] for out in outs]
    logprobs = [[lp for o in out for lp in (o.logprobs or [])] for out in outs]
    for out in outs:
        assert out[-1].finish_reason == "length", out[-1]
    engine.check_idle_integrity()
    return Run(case, hf, prompts, tokens, logprobs, ckpt)


def test_checkpoint_is_sharded_with_index(run: Run) -> None:
    with open(os.path.join(run.ckpt, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    shards = {n for n in os.listdir(run.ckpt) if n.endswith(".safetensors")}
    assert len(shards) > 1 and set(weight_map.values()) == shards
    tied = run.case.endswith("-tied")
    assert ("lm_head.weight" in weight_map) is not tied


def test_loaded_config_matches(run: Run) -> None:
    from kvrelay.weights.hf_dir import read_config

    c = read_config(run.ckpt)
    hc = run.hf.config
    assert c.tie_word_embeddings == run.case.endswith("-tied")
    assert c.attention_bias == run.case.startswith("qwen2")
    assert c.qk_norm == run.case.startswith("qwen3")
    assert c.head_dim == (32 if run.case.startswith("qwen3") else 16)
    assert c.rms_norm_eps == hc.rms_norm_eps
    if run.case.startswith("llama3"):
        assert c.rope_scaling is not None and c.rope_scaling["rope_type"] == "llama3"
        assert c.rope_theta == 10000.0
    else:
        assert c.rope_scaling is None


def test_greedy_tokens_match_hf_generate(run: Run) -> None:
    for prompt, ours in zip(run.prompts, run.tokens, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = run.hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert ours == ref[0, len(prompt) :].tolist(), f"prompt length {len(prompt)}"


def test_logprobs_match_hf_log_softmax(run: Run) -> None:
    for prompt, toks, lps in zip(run.prompts, run.tokens, run.logprobs, strict=True):
        assert len(lps) == len(toks) == NEW_TOKENS
        # Teacher-forced on our own tokens, so this holds even where the greedy test fails.
        seq = torch.tensor([prompt + toks])
        with torch.no_grad():
            logits = run.hf(seq).logits[0].float()
        ref = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        ref = ref.gather(1, torch.tensor(toks)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(lps), ref, atol=1e-4, rtol=0)
        # Greedy: the chosen token is the most likely one under HF too.
        assert (
            ref >= torch.log_softmax(logits[len(prompt) - 1 : -1], -1).max(-1).values - 1e-4
        ).all()
