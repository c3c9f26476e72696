"""HF transformers' DeepseekV4ForCausalLM as the test oracle: load it, run its full forward, greedy
decode with it, and have it write tiny checkpoints itself (save_pretrained).

Greedy decoding re-runs the full forward on the whole sequence for every token: transformers'
cached generation selects indexer entries over rows of another length and is not an oracle
(see tests/models/test_deepseek_v4_hf_parity.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from kvrelay.models.deepseek_v4 import DeepseekV4Config, DeepseekV4ForCausalLM, init_dummy_weights


def load_hf(path: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(
        str(path), dtype=dtype, attn_implementation="eager"
    )
    return hf.eval()


@torch.no_grad()
def hf_logits(hf: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """[T] -> [T, vocab], or [B, T] -> [B, T, vocab]."""
    return hf(ids if ids.dim() == 2 else ids[None]).logits.squeeze(0)


@torch.no_grad()
def hf_greedy(
    hf: torch.nn.Module, prompt: list[int], max_new_tokens: int, eos: int | None = None
) -> list[int]:
    """The argmax continuation of `prompt`, stopping after `eos` (included) or the budget."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        last = hf(torch.tensor([ids]), logits_to_keep=1).logits[0, -1]  # no head over the rest
        nxt = int(last.argmax())
        ids.append(nxt)
        if nxt == eos:
            break
    return ids[len(prompt) :]


@torch.no_grad()
def save_with_transformers(
    cfg: DeepseekV4Config,
    path: Path,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
) -> torch.nn.Module:
    """transformers' model of `cfg` holding kvrelay's dummy weights (scaled so that logits are
    peaked, every tensor distinct), written by its own save_pretrained; returns that model."""
    hf = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**cfg.to_hf_dict()))
    ours = DeepseekV4ForCausalLM(cfg)
    init_dummy_weights(ours, seed)
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    assert not missing and all(k.startswith("model.mtp.") for k in unexpected), missing
    hf = hf.to(dtype).eval()
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    hf.save_pretrained(str(path), **kw)
    return hf


@torch.no_grad()
def hf_generate(hf: torch.nn.Module, prompt: list[int], max_new_tokens: int, eos: int) -> list[int]:
    """transformers' own cached greedy generation, stopping after `eos` (included). Faster than
    `hf_greedy`, and equal to it only while the indexer keeps every compressed entry
    (index_topk >= the ratio-4 entries of the whole sequence): the caller checks that."""
    out = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    return out[0, len(prompt) :].tolist()
