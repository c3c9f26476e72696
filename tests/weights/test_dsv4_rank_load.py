"""Per-rank DeepSeek-V4 checkpoint loading (weights/dsv4_rank_load.py): each TP=2 rank's weights
equal loading the whole model and cutting it (`shard_model`), tensor by tensor and bit for bit,
for every naming and quantization the loader reads; and a rank reads about half of every split
tensor, all of every replicated one, and with expert parallel none of the other rank's experts.

Bytes are counted by a `SafetensorsReader` that records what each box read (the real reads).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from counting_reader import CountingReader
from dsv4_hf import save_with_transformers

from kvrelay.layers.parallel import TPGroup
from kvrelay.models.deepseek_v4 import DeepseekV4ForCausalLM, init_dummy_weights, preset
from kvrelay.quant import ExpertSlot, quantize_fp8_block, quantize_mxfp4
from kvrelay.weights.dsv4_checkpoint import Dsv4Checkpoint
from kvrelay.weights.dsv4_rank_load import load_rank
from kvrelay.weights.dsv4_tp import rank_slices, shard_model
from kvrelay.weights.dsv4_writer import save_dsv4_checkpoint, save_safetensors
from kvrelay.weights.loader import build_model, resolve

# Wide enough for whole 128x128 FP8 blocks and 32-wide MXFP4 blocks on each rank's half.
CFG = preset("dsv4-tiny").with_(hidden_size=256, q_lora_rank=128, moe_intermediate_size=64)
AGENT = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "dsv4-tiny-agent"
CPU = torch.device("cpu")
FP8 = re.compile(
    r".*\.(self_attn\.(q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj|compressor\.indexer\.q_b_proj)"
    r"|mlp\.shared_experts\.(gate_proj|up_proj|down_proj))\.weight"
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops


def _hf_quantized(model: torch.nn.Module, path: Path) -> None:
    """HF names with FP8 `.weight_scale_inv` linears and packed-MXFP4 fused experts."""
    tensors = {}
    for name, t in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name], tensors[name + "_scale_inv"] = quantize_mxfp4(t)
        elif FP8.fullmatch(name):
            q, scale = quantize_fp8_block(t, scale_format="float32")
            tensors[name], tensors[name[: -len("weight")] + "weight_scale_inv"] = q, scale
        else:
            tensors[name] = t
    save_safetensors(tensors, str(path))
    (path / "config.json").write_text(json.dumps(CFG.to_hf_dict()))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    model = DeepseekV4ForCausalLM(CFG)
    init_dummy_weights(model, seed=3)
    out = {}
    for layout, shards in (("hf", 2), ("native", 1), ("nvfp4", 2)):
        path = tmp_path_factory.mktemp(layout)
        save_dsv4_checkpoint(model, str(path), layout, shards=shards)
        out[layout] = str(path)
    out["hf-fp8-mxfp4"] = str(tmp_path_factory.mktemp("hfq"))
    _hf_quantized(model, Path(out["hf-fp8-mxfp4"]))
    saved = tmp_path_factory.mktemp("saved")
    save_with_transformers(CFG.with_(qat_simulation=False), saved, 5, torch.bfloat16, "200KB")
    out["transformers"] = str(saved)
    if (AGENT / "config.json").is_file():
        out["agent"] = str(AGENT)
    return out


LAYOUTS = ("hf", "native", "nvfp4", "hf-fp8-mxfp4", "transformers", "agent")


def _cut_whole(path: str, rank: int, ep: bool) -> torch.nn.Module:
    model = build_model(resolve(path), torch.float32, CPU)
    shard_model(model, TPGroup(rank, 2), ep)
    return model


def _stored_rules(path: str, ep: bool) -> dict[str, list[list]]:
    """Stored name -> each rank's slices of the model tensor it fills ([] = read whole)."""
    out = {}
    with Dsv4Checkpoint(path) as ckpt:
        for name in ckpt.weight_names():
            target = ckpt.model_target(name)
            if target is None:
                continue
            model_name = target.hf_name if isinstance(target, ExpertSlot) else target
            shape = (CFG.n_routed_experts, 4, 4) if isinstance(target, ExpertSlot) else None
            shape = shape or ckpt.index[name].shape
            rules = [rank_slices(model_name, shape, TPGroup(r, 2), ep) for r in range(2)]
            for stored in (name, *ckpt.quant(name).companions.values()):
                out[ckpt.index[stored].stored] = rules
    return out


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "tp2+ep"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_rank_load_equals_load_then_cut(dirs, layout: str, ep: bool) -> None:
    if layout not in dirs:
        pytest.skip(f"no model at {AGENT}")
    path = dirs[layout]
    cfg = resolve(path).config
    rules, sizes = _stored_rules(path, ep), _stored_sizes(path)
    for rank in range(2):
        reader = CountingReader()
        got = load_rank(path, cfg, torch.float32, CPU, TPGroup(rank, 2), ep, reader)
        whole = _cut_whole(path, rank, ep)
        own, want = got.state_dict(), whole.state_dict()
        # No MTP block in the checkpoint: the rank's model has none (the whole one a random one).
        assert set(want) - set(own) <= {k for k in want if k.startswith("model.mtp.")}
        assert set(own) <= set(want)
        for name, t in own.items():
            assert t.dtype == want[name].dtype and torch.equal(t, want[name]), name
        for mod_got, mod_want in zip(got.modules(), whole.modules(), strict=False):
            for attr in ("n_heads", "o_groups", "local_experts"):
                assert getattr(mod_got, attr, None) == getattr(mod_want, attr, None)
        _check_reads(reader.bytes, sizes, rules, rank, ep, path)


def _stored_sizes(path: str) -> dict[str, int]:
    with Dsv4Checkpoint(path) as ckpt:
        return {
            info.stored: math.prod(info.shape) * _ITEM.get(info.dtype, 1)  # F8_*: 1 byte
            for info in ckpt.index.values()
        }


def _check_reads(read, sizes, rules, rank: int, ep: bool, path: str) -> None:
    split = {n for n, r in rules.items() if r[rank]}
    for name, whole in sizes.items():
        got = read.get(name, 0)
        m = re.search(r"experts\.(\d+)\.", name)
        if name.endswith("input_scale"):  # NVFP4 activation scales: not needed to load
            assert got == 0, name
        elif ep and m is not None:  # a native expert's tensor: whole if it is ours, else untouched
            mine = rank * 4 <= int(m.group(1)) < (rank + 1) * 4
            assert got == (whole if mine else 0), (name, got, whole)
        elif name not in split:
            assert got == whole, f"{name}: replicated, read {got} of {whole} bytes"
        elif "scale" in name:  # a scale block cut by the split is read by both ranks
            assert got <= whole, (name, got, whole)
        else:  # exactly this rank's half
            assert got == whole // 2, (name, got, whole)
    total_split = sum(sizes[n] for n in split)
    read_split = sum(read.get(n, 0) for n in split)
    assert read_split <= 0.52 * total_split, (path, read_split, total_split)


_ITEM = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1}


def test_rank_load_for_all_to_all_dispatch_keeps_the_shared_expert_whole(dirs) -> None:
    """`--ep-dispatch all-to-all`: each rank runs the shared expert on its own tokens."""
    from kvrelay.models.deepseek_v4.moe import MoE

    path = dirs["hf"]
    got = load_rank(path, resolve(path).config, torch.float32, CPU, TPGroup(1, 2), True,
                    ep_all_to_all=True)  # fmt: skip
    whole = build_model(resolve(path), torch.float32, CPU)
    shared = whole.model.layers[0].mlp.shared_experts.down_proj.weight.clone()
    shard_model(whole, TPGroup(1, 2), True, True)
    want = whole.state_dict()
    for name, t in got.state_dict().items():
        assert torch.equal(t, want[name]), name
    assert torch.equal(got.model.layers[0].mlp.shared_experts.down_proj.weight, shared)
    assert all(m.all_to_all for m in got.modules() if isinstance(m, MoE))
