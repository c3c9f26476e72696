"""Cutting DeepSeek-V4 to a tensor-parallel rank (weights/dsv4_tp.py): which slices a rank keeps,
expert parallel on the MoE alone (two gloo processes == one), and the combinations refused at
startup. The whole model under TP/EP is tested through the engine in
tests/engine/test_dsv4_tensor_parallel.py."""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch
from conftest import end_rank

from kvrelay.config import EngineConfig
from kvrelay.layers.parallel import TPGroup
from kvrelay.models.deepseek_v4 import DeepseekV4ForCausalLM, init_dummy_weights, preset
from kvrelay.weights.dsv4_tp import shard_model

CFG = preset("dsv4-tiny")  # 4 heads, 2 output groups, 16 index heads, 8 experts, vocab 256


def _model(experts: str = "dense") -> DeepseekV4ForCausalLM:
    model = DeepseekV4ForCausalLM(CFG.with_(expert_format=experts), torch.float32, with_mtp=False)
    init_dummy_weights(model, 0)
    return model.eval()


@pytest.mark.parametrize("ep", [False, True], ids=["tp", "tp+ep"])
def test_rank_holds_its_slices(ep: bool):
    full, part = _model(), _model()
    shard_model(part, TPGroup(1, 2), expert_parallel=ep)
    fa, pa = full.model.layers[1].self_attn, part.model.layers[1].self_attn  # a CSA layer
    hd = CFG.head_dim
    assert (pa.n_heads, pa.o_groups) == (2, 1)
    torch.testing.assert_close(pa.q_b_proj.weight, fa.q_b_proj.weight[2 * hd :], rtol=0, atol=0)
    torch.testing.assert_close(pa.sinks, fa.sinks[2:], rtol=0, atol=0)
    rank = CFG.o_lora_rank
    assert torch.equal(pa.o_a_proj.weight, fa.o_a_proj.weight[rank:])
    assert torch.equal(pa.o_b_proj.weight, fa.o_b_proj.weight[:, rank:])
    # The shared KV head, q_a and the compressors stay whole.
    assert torch.equal(pa.kv_proj.weight, fa.kv_proj.weight)
    assert torch.equal(pa.q_a_proj.weight, fa.q_a_proj.weight)
    assert torch.equal(pa.compressor.kv_proj.weight, fa.compressor.kv_proj.weight)
    ix = pa.indexer
    assert (ix.n_heads, ix.all_heads) == (8, 16)
    assert torch.equal(ix.kv_proj.weight, fa.indexer.kv_proj.weight)  # index keys: whole
    d = CFG.index_head_dim
    assert torch.equal(ix.q_b_proj.weight, fa.indexer.q_b_proj.weight[8 * d :])
    assert torch.equal(ix.scorer.weights_proj.weight, fa.indexer.scorer.weights_proj.weight[8:])
    # mHC and the router: whole.
    fl, pl = full.model.layers[2], part.model.layers[2]
    assert torch.equal(pl.attn_hc.fn, fl.attn_hc.fn)
    assert torch.equal(pl.mlp.gate.weight, fl.mlp.gate.weight)
    i = CFG.moe_intermediate_size
    fs, ps = fl.mlp.shared_experts, pl.mlp.shared_experts
    assert torch.equal(ps.gate_proj.weight, fs.gate_proj.weight[i // 2 :])
    assert torch.equal(ps.down_proj.weight, fs.down_proj.weight[:, i // 2 :])
    fe, pe = fl.mlp.experts, pl.mlp.experts
    if ep:  # experts 4..7 whole
        assert pl.mlp.local_experts == (4, 4)
        assert torch.equal(pe.gate_up_proj, fe.gate_up_proj[4:])
        assert torch.equal(pe.down_proj, fe.down_proj[4:])
    else:  # every expert's [gate_1; up_1] rows and the matching down columns
        assert pl.mlp.local_experts is None
        gate, up = fe.gate_up_proj.chunk(2, dim=1)
        want = torch.cat((gate[:, i // 2 :], up[:, i // 2 :]), dim=1)
        assert torch.equal(pe.gate_up_proj, want)
        assert torch.equal(pe.down_proj, fe.down_proj[:, :, i // 2 :])
    # Vocabulary rows 128..255.
    assert torch.equal(part.model.embed_tokens.weight, full.model.embed_tokens.weight[128:])
    assert torch.equal(part.lm_head.weight, full.lm_head.weight[128:])


def _moe_rank(rank: int, port: int, mode: str, experts: str, results) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from kvrelay.engine.tp_worker import init_distributed

    init_distributed(rank, 2, "127.0.0.1", port, "cpu")
    try:
        model = _model(experts)
        shard_model(model, TPGroup.from_default(2), mode != "tp2", mode == "ep2-all-to-all")
        x, ids = _moe_input()
        with torch.no_grad():  # layer 0 is hash-routed, layer 2 bias-routed
            outs = [model.model.layers[i].mlp(x, ids).numpy() for i in (0, 2)]
        if rank == 0:
            results.put(outs)
    finally:
        dist.destroy_process_group()
    end_rank(results)


def _moe_input() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(97, CFG.hidden_size, generator=g)  # odd: all-to-all ranks own 48 and 49
    return x, torch.randint(0, CFG.vocab_size, (97,), generator=g)


@pytest.mark.parametrize("experts", ["dense", "nvfp4"])
@pytest.mark.parametrize("mode", ["ep2", "tp2", "ep2-all-to-all"])
def test_moe_over_two_ranks_matches_one(mode: str, experts: str):
    """The MoE alone, hash- and bias-routed, dense or packed NVFP4 experts (cut by packed
    bytes and scale blocks): two ranks' partial outputs summed (or, all-to-all, each rank's
    tokens sent to their experts' ranks and back, then gathered) == one rank, with tokens routed
    to both ranks' experts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_moe_rank, args=(r, port, mode, experts, results)) for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        outs = results.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    model = _model(experts)
    x, ids = _moe_input()
    for out, i in zip(outs, (0, 2), strict=True):
        mlp = model.model.layers[i].mlp
        _, idx = mlp.gate(x, ids)
        assert (idx < 4).any() and (idx >= 4).any()  # both ranks' experts are used
        with torch.no_grad():
            want = mlp(x, ids)
        # float32: the two partial sums associate differently from one rank's single sum
        torch.testing.assert_close(torch.from_numpy(out), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"device": "cuda"}, "CPU"),
        ({"attention_backend": "triton"}, "CPU"),
        ({"linear_weights": "fp8"}, "linear-weights fp8"),
        ({"tensor_parallel_size": 1, "expert_parallel": True}, "expert-parallel needs"),
        ({"ep_dispatch": "all-to-all"}, "ep-dispatch all-to-all needs --expert-parallel"),
    ],
)
def test_unsupported_combinations_are_refused(changes, match):
    from kvrelay.models.deepseek_v4.runnable import check_parallel

    cfg = EngineConfig(**{"device": "cpu", "tensor_parallel_size": 2, **changes})
    with pytest.raises(ValueError, match=match):
        check_parallel(cfg, torch.device(cfg.device))


def test_expert_parallel_is_refused_for_dense_models():
    from kvrelay.engine.runner import ModelRunner
    from kvrelay.models import registry
    from kvrelay.weights.loader import ModelSource

    src = ModelSource("qwen3-tiny", "dummy", None, registry.preset("qwen3-tiny")[1], "", None)
    cfg = EngineConfig(load_format="dummy", device="cpu", expert_parallel=True)
    with pytest.raises(ValueError, match="are for DeepSeek-V4"):
        ModelRunner(cfg, src)
