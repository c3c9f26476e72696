"""Cut a loaded DeepSeek-V4 model to one tensor-parallel rank's part, in place.

The model is built and loaded whole (dummy weights drawn as for one rank), then each tensor is cut
by the rules of `dsv4_shard`, so TP=N starts from exactly the weights of TP=1:
- attention: this rank's q heads (q_b_proj, sinks), its output groups (o_a_proj) and the matching
  input slice of o_b_proj (partial sums, all-reduced); the single shared KV head, q_a_proj, the
  compressors and norms stay whole (every rank computes them identically).
- indexer: this rank's index heads (q_b_proj, weights_proj); scores are summed before top-k.
- MoE: the router stays whole; the shared expert is column/row split; routed experts are split by
  their intermediate dim, or with expert parallel by expert (ranks hold E/N experts each). With
  all-to-all dispatch (`ep_all_to_all`) each rank runs the shared expert on its own tokens: whole.
- embedding and LM head: ceil(V/N) vocabulary rows per rank (zero padded), as dense models do.
- mHC and the final norm: whole.
"""

from __future__ import annotations

import torch
from torch import nn

from kvrelay.layers.parallel import TPGroup, VocabParallelEmbedding, vocab_shard
from kvrelay.models.deepseek_v4.attention import Attention
from kvrelay.models.deepseek_v4.experts import Experts, QuantizedExperts
from kvrelay.models.deepseek_v4.moe import MoE
from kvrelay.weights.dsv4_shard import Slice, shard_slices, take

VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


@torch.no_grad()
def shard_model(
    model: nn.Module, tp: TPGroup, expert_parallel: bool = False, ep_all_to_all: bool = False
) -> None:
    """Keep only rank `tp.rank`'s part of `model` (a DeepseekV4ForCausalLM) and give its layers
    the group to reduce over. World 1 leaves the model as it is."""
    if not tp.is_parallel:
        return
    c = model.config
    for name, p in list(model.named_parameters()):
        if ".mlp.experts." in name or name in VOCAB:
            continue  # cut below: by the MoE's mode; by vocabulary rows
        part = take(p, rank_slices(name, tuple(p.shape), tp, expert_parallel, ep_all_to_all))
        if part.shape != p.shape:
            _replace(model, name, part)
    for m in model.modules():
        if isinstance(m, Attention):
            _attention(m, tp)
        elif isinstance(m, MoE):
            _moe(m, tp, expert_parallel, c.n_routed_experts)
            m.all_to_all = ep_all_to_all
    _vocab(model, tp)
    model.tp = tp


def rank_slices(
    name: str,
    shape: tuple[int, ...],
    tp: TPGroup,
    expert_parallel: bool,
    ep_all_to_all: bool = False,
) -> list[Slice]:
    """The slices of the whole tensor `name` (model name) that `shard_model` keeps on this rank;
    [] means all of it. A vocabulary table's rank holds more rows than it reads at the tail:
    the rest are zeros."""
    if name in VOCAB:
        start, rows = vocab_shard(shape[0], tp)
        return [(0, start, min(start + rows, shape[0]))]
    owner, _, leaf = name.rpartition(".")
    if owner.endswith(".mlp.experts"):
        return expert_slices(leaf, shape, tp, expert_parallel)
    if ep_all_to_all and ".mlp.shared_experts." in name:
        return []  # each rank runs the whole shared expert on the tokens it owns
    return shard_slices(name, shape, tp.rank, tp.world)


def _attention(a: Attention, tp: TPGroup) -> None:
    a.n_heads = tp.split(a.n_heads, "num_attention_heads")
    a.o_groups = a.o_a_proj.groups = tp.split(a.o_groups, "o_groups")
    a.tp = tp
    if a.indexer is not None:
        a.indexer.n_heads = tp.split(a.indexer.n_heads, "index_n_heads")
        a.indexer.tp = tp


def _moe(m: MoE, tp: TPGroup, expert_parallel: bool, n_experts: int) -> None:
    ex = m.experts
    for name, t in _expert_tensors(ex):
        slices = expert_slices(name, tuple(t.shape), tp, expert_parallel)
        if slices:
            _replace(ex, name, take(t, slices))
    if expert_parallel:
        count = tp.split(n_experts, "n_routed_experts")
        m.local_experts = (tp.rank * count, count)
    m.tp = tp


def expert_slices(
    leaf: str, shape: tuple[int, ...], tp: TPGroup, expert_parallel: bool
) -> list[Slice]:
    """This rank's part of the routed-expert tensor `leaf` (gate_up_proj, down_packed, ...) of
    `shape` [E, ...]: E/N whole experts with expert parallel; else [gate_r; up_r] rows of the
    gate_up tensors and the matching input columns of the down ones (per-expert global scales
    whole)."""
    if expert_parallel:
        count = tp.split(shape[0], "n_routed_experts")
        return [(0, tp.rank * count, (tp.rank + 1) * count)]
    if leaf.endswith("scale_2"):
        return []
    rule = "gate_up_proj" if leaf.startswith("gate_up") else "down_proj"
    return shard_slices(f"model.layers.0.mlp.experts.{rule}", shape, tp.rank, tp.world)


def _expert_tensors(ex: Experts) -> list[tuple[str, torch.Tensor]]:
    if isinstance(ex, QuantizedExperts):
        return list(ex.named_buffers())
    return list(ex.named_parameters())


def _vocab(model: nn.Module, tp: TPGroup) -> None:
    """Both vocabulary tables to this rank's rows; the last rank's tail rows are zeros."""
    c = model.config
    start, rows = vocab_shard(c.vocab_size, tp)
    full = model.model.embed_tokens.weight
    emb = VocabParallelEmbedding(c.vocab_size, c.hidden_size, tp).to(full.device, full.dtype)
    emb.weight.copy_(_rows(full, start, rows))
    model.model.embed_tokens = emb
    if c.tie_word_embeddings:
        model.lm_head.weight = emb.weight
    else:
        _replace(model, "lm_head.weight", _rows(model.lm_head.weight, start, rows))


def _rows(w: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    out = w.new_zeros(rows, w.shape[1])
    part = w[start : start + rows]
    out[: part.shape[0]] = part
    return out


def _replace(root: nn.Module, name: str, value: torch.Tensor) -> None:
    """Swap the parameter or buffer `name` for `value` (a copy: the full tensor is freed)."""
    owner, _, leaf = name.rpartition(".")
    mod = root.get_submodule(owner) if owner else root
    value = value.contiguous().clone()
    if leaf in mod._parameters:
        mod._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        mod._buffers[leaf] = value
