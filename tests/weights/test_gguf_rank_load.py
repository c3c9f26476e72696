"""Tensor-parallel ranks reading a GGUF (weights/gguf_reader.py): each rank dequantizes only the
rows or quant-block columns it keeps from the memory-mapped file, and gets exactly the weights
of dequantizing everything and cutting (q/k heads un-permuted per rank's heads included).

The embedded SmolLM2 (3 kv heads) cannot run TP=2, so a tiny Llama GGUF is written here with
Q4_1 / Q8_0 tensors; its vocabulary (99) does not split evenly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quantize

from kvrelay.layers.parallel import TPGroup
from kvrelay.models.llama.model import LlamaForCausalLM
from kvrelay.weights import gguf_reader

HIDDEN, HEADS, KV_HEADS, VOCAB = 64, 4, 2, 99
HD = HIDDEN // HEADS


def _write(path, ffn: int) -> None:
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(ffn)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_vocab_size(VOCAB)
    w.add_layer_norm_rms_eps(1e-5)

    def add(name: str, rows: int, cols: int, qtype: Q) -> None:
        a = rng.standard_normal((rows, cols), dtype=np.float32)
        w.add_tensor(name, quantize(a, qtype), raw_dtype=qtype)

    add("token_embd.weight", VOCAB, HIDDEN, Q.Q8_0)
    add("output.weight", VOCAB, HIDDEN, Q.Q4_1)
    w.add_tensor("output_norm.weight", rng.standard_normal(HIDDEN, dtype=np.float32))
    for leaf, rows, cols in (
        ("attn_q", HEADS * HD, HIDDEN),
        ("attn_k", KV_HEADS * HD, HIDDEN),
        ("attn_v", KV_HEADS * HD, HIDDEN),
        ("attn_output", HIDDEN, HEADS * HD),
        ("ffn_gate", ffn, HIDDEN),
        ("ffn_up", ffn, HIDDEN),
        ("ffn_down", HIDDEN, ffn),
    ):
        add(f"blk.0.{leaf}.weight", rows, cols, Q.Q4_1)
    for leaf in ("attn_norm", "ffn_norm"):
        w.add_tensor(f"blk.0.{leaf}.weight", rng.standard_normal(HIDDEN, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("ffn", [128, 96], ids=["blocks", "cut-block"])
def test_ranks_dequantize_only_their_slices(tmp_path, ffn: int):
    """ffn 96: down_proj's 48 columns per rank cut a 32-wide Q4_1 block, so whole rows are
    dequantized and cut after."""
    path = tmp_path / "tiny.gguf"
    _write(path, ffn)
    reader = gguf_reader.open_gguf(str(path))
    cfg = gguf_reader.read_config(reader)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (HEADS, KV_HEADS, VOCAB)
    whole = {t.name: t.data.nbytes for t in reader.tensors}
    for rank in range(2):
        sliced, cut = (LlamaForCausalLM(cfg, TPGroup(rank, 2)) for _ in range(2))
        nbytes: dict[str, int] = {}
        weights = gguf_reader.read_weights(reader, cfg, sliced.shard_range, nbytes)
        sliced.load_weights(weights, presharded=True)
        cut.load_weights(gguf_reader.read_weights(reader, cfg))
        for (name, a), b in zip(sliced.named_parameters(), cut.parameters(), strict=True):
            assert torch.equal(a, b), name
        for t in reader.tensors:
            name = gguf_reader._hf_name(t.name)
            if "norm" in name:
                assert nbytes[name] == whole[t.name], name
            elif name.endswith("down_proj.weight") and ffn % 64:
                assert nbytes[name] == whole[t.name], name
            elif "embed" in name or "lm_head" in name:  # 50 rows, then 49
                assert nbytes[name] == whole[t.name] * (50 - rank) // VOCAB, name
            else:  # exactly half: rows, or whole Q4_1 blocks of columns
                assert nbytes[name] * 2 == whole[t.name], name
