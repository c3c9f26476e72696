"""Read a Llama-family GGUF file: config from its metadata, weights dequantized to HF names."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from kvrelay.config import ModelConfig
from kvrelay.models.registry import gguf_architecture
from kvrelay.weights.gguf_file import GGUFFile

if TYPE_CHECKING:  # imported where weights are read: the API process reads only the config
    import torch

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _field(reader: GGUFFile, key: str, default=None):
    return reader.fields.get(key, default)


def read_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    architecture = gguf_architecture(arch)

    def get(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(get("vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 8192)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp stores q/k rows interleaved for its RoPE; HF expects the rotate-half order.
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def read_weights(
    reader, cfg: ModelConfig, shard_range=None, nbytes: dict[str, int] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor by HF name, dequantized to float32. With `shard_range(name, shape) ->
    (dim, start, stop) | None` (tensor parallel) only that slice of each tensor is dequantized
    from the memory-mapped file (rows: a view; columns: whole quant blocks of every row);
    `nbytes` (tests) gets the bytes each tensor's read touched."""
    import torch

    permute = cfg.architecture == "LlamaForCausalLM"
    for t in reader.tensors:
        name = _hf_name(t.name)
        shape = [int(d) for d in reversed(t.shape)]
        r = None if shard_range is None else shard_range(name, shape)
        data, rows = t.data, shape[0]
        if r is not None:
            data, shape = _slice(t, shape, *r)
        heads = shape[0] / rows  # the share of q/k heads in a row slice (1 for whole rows)
        if nbytes is not None:
            nbytes[name] = data.nbytes
        w = _dequantize(data, t.tensor_type).reshape(shape)
        if r is not None and r[0] == 1 and w.shape[1] != r[2] - r[1]:
            w = w[:, r[1] : r[2]]  # columns inside a quant block: whole rows were read
        if permute and name.endswith("q_proj.weight"):
            w = _unpermute(w, round(cfg.num_heads * heads))
        elif permute and name.endswith("k_proj.weight"):
            w = _unpermute(w, round(cfg.num_kv_heads * heads))
        if w.dtype != np.float32 or not w.flags.writeable or not w.flags.c_contiguous:
            w = np.array(w, dtype=np.float32)  # F32 tensors are views of the read-only mapping
        yield name, torch.from_numpy(w)


def _dequantize(data: np.ndarray, qtype) -> np.ndarray:
    """gguf's `dequantize` (float32), its own per-block arithmetic; a block-quantized tensor goes
    through gguf's `dequantize_rows` 256 rows at a time instead of its 16 (half the time here:
    per-call overhead; the same values, element by element)."""
    from gguf import quants
    from gguf.constants import GGML_QUANT_SIZES

    # `_type_traits` is gguf's private table: without it (another gguf version), gguf as is.
    q = getattr(quants, "_type_traits", {}).get(qtype)
    if q is None or getattr(q, "grid_hex", None) is not None or not hasattr(q, "dequantize_rows"):
        return quants.dequantize(data, qtype)  # plain floats, a grid type, or an unknown gguf
    block, size = GGML_QUANT_SIZES[qtype]
    rows = data.reshape(-1, data.shape[-1])
    out = np.empty((rows.shape[0], rows.shape[1] // size * block), dtype=np.float32)
    for i in range(0, rows.shape[0], 256):
        out[i : i + 256] = q.dequantize_rows(rows[i : i + 256])
    return out.reshape(*data.shape[:-1], out.shape[-1])


def _slice(t, shape: list[int], dim: int, start: int, stop: int):
    """(data, logical shape) of rows or columns [start, stop) of a 2-D tensor's raw data."""
    from gguf.constants import GGML_QUANT_SIZES

    if dim == 0:  # rows of a row-major tensor: a view of the mapping
        return t.data[start:stop], [stop - start, *shape[1:]]
    block = GGML_QUANT_SIZES[t.tensor_type][0]
    if start % block or stop % block:  # cuts a quant block: read whole rows, cut after
        return t.data, shape
    unit = t.data.shape[-1] * block // shape[-1]  # data columns per quant block
    return t.data[:, start // block * unit : stop // block * unit], [shape[0], stop - start]


def open_gguf(path: str):
    """The parsed file, once per process (the server's API and engine and the loader each ask
    for it; a file changed on disk is parsed again)."""
    st = os.stat(path)
    return _open_gguf(os.path.realpath(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _open_gguf(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)
