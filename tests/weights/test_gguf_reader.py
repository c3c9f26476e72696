"""The GGUF reader: kvrelay's own parse equals gguf's, field by field and tensor by tensor (a
written file with every metadata kind, plain and quantized tensors; the embedded SmolLM2 is read
through it by every served and HF-parity test), and a file is parsed once per process unless it
changes on disk."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from kvrelay.weights.gguf_reader import _dequantize, open_gguf


def _write(path, n_tokens: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_string("general.name", "tiny ✓")
    w.add_int64("general.some_int64", -(1 << 40))
    w.add_float64("general.some_float64", 0.1)
    w.add_array("general.flags", [True, False, True])
    w.add_token_list([f"tok{i}" for i in range(n_tokens)])
    w.add_token_scores([float(i) for i in range(n_tokens)])
    w.add_token_types([i % 5 for i in range(n_tokens)])
    w.add_array("tokenizer.ggml.merges", ["a b", "ab c"])
    w.add_tensor("token_embd.weight", rng.standard_normal((n_tokens, 8), dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", rng.standard_normal((8, 8)).astype(np.float16))
    q = GGMLQuantizationType.Q8_0
    w.add_tensor(
        "blk.0.attn_k.weight",
        quantize(rng.standard_normal((4, 64), dtype=np.float32), q),
        raw_shape=(4, 64 // 32 * 34),
        raw_dtype=q,
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _same(path: str) -> None:
    ours, theirs = open_gguf(path), GGUFReader(path)
    assert list(ours.fields) == [k for k in theirs.fields if not k.startswith("GGUF.")]
    for name, f in theirs.fields.items():
        if not name.startswith("GGUF."):
            assert ours.fields[name] == f.contents(), name
    assert ours.data_offset == theirs.data_offset
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.n_bytes, a.data_offset) == (
            b.name, b.tensor_type, b.n_bytes, b.data_offset,
        )  # fmt: skip
        assert list(a.shape) == list(b.shape) and a.data.dtype == b.data.dtype
        assert a.data.shape == b.data.shape
        np.testing.assert_array_equal(a.data, b.data)


def test_own_parse_equals_gguf_reader(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write(path, 300, seed=0)
    _same(str(path))


def test_parsed_once_per_process_and_again_once_changed(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write(path, 10, seed=0)
    first = open_gguf(str(path))
    assert open_gguf(str(path)) is first
    _write(path, 20, seed=1)  # a new file at the same path (size and mtime differ)
    second = open_gguf(str(path))
    assert second is not first
    assert len(second.fields["tokenizer.ggml.tokens"]) == 20


def test_dequantize_equals_gguf_bit_for_bit(tmp_path):
    """The loader's dequantizer (gguf's rows, grouped by 256) gives gguf's own `dequantize`,
    bit for bit: the first tensor of each type in the embedded SmolLM2 (Q4_1, Q8_0, F32), whole
    (up to 600 rows) and cut to quant-block columns (a TP rank's read), and synthetic quantized
    tensors of over 256 rows (HF parity checks the whole file's result against transformers'
    own dequantization)."""
    from kvrelay.weights.loader import resolve

    def same(data, qtype) -> None:
        want = np.asarray(dequantize(data, qtype), dtype=np.float32)
        got = _dequantize(data, qtype)
        assert got.shape == want.shape and got.dtype == np.float32
        np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))

    types = set()
    for t in open_gguf(resolve("smollm2").path).tensors:
        if t.tensor_type in types:  # one code path per type: its first tensor says it
            continue
        rows = t.data[:600]  # the embedding has 49k rows: 600 span three groups of 256
        same(rows, t.tensor_type)
        if t.tensor_type != GGMLQuantizationType.F32:
            same(rows[:, : rows.shape[1] // 2], t.tensor_type)
        types.add(t.tensor_type)
    assert {GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0} <= types
    rng = np.random.default_rng(0)
    for q in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0):
        same(quantize(rng.standard_normal((600, 64), dtype=np.float32), q), q)
    # A k-quant (gguf cannot quantize to it): random blocks of 144 bytes, 600 rows of one.
    same(rng.integers(0, 256, (600, 144), dtype=np.uint8), GGMLQuantizationType.Q4_K)
