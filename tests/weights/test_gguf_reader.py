"""The GGUF reader: kvrelay's faster parse equals gguf's own, field by field and tensor by tensor,
and a file is parsed once per process unless it changes on disk."""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader, GGUFWriter

from kvrelay.weights.gguf_reader import open_gguf


def _write(path, n_tokens: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_string("general.name", "tiny ✓")
    w.add_token_list([f"tok{i}" for i in range(n_tokens)])
    w.add_token_scores([float(i) for i in range(n_tokens)])
    w.add_array("tokenizer.ggml.merges", ["a b", "ab c"])
    w.add_tensor("token_embd.weight", rng.standard_normal((n_tokens, 8), dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", rng.standard_normal((8, 8)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_fast_parse_equals_gguf_reader(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write(path, 300, seed=0)
    ours, theirs = open_gguf(str(path)), GGUFReader(str(path))
    assert list(ours.fields) == list(theirs.fields)
    for name, f in theirs.fields.items():
        g = ours.fields[name]
        assert (g.offset, g.types, g.data) == (f.offset, f.types, f.data), name
        assert [p.tobytes() for p in g.parts] == [p.tobytes() for p in f.parts], name
        assert [p.dtype for p in g.parts] == [p.dtype for p in f.parts], name
        assert g.contents() == f.contents(), name
    assert ours.data_offset == theirs.data_offset
    assert len(ours.tensors) == len(theirs.tensors) == 2
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.n_bytes, a.data_offset) == (
            b.name, b.tensor_type, b.n_bytes, b.data_offset,
        )  # fmt: skip
        assert list(a.shape) == list(b.shape) and a.data.dtype == b.data.dtype
        np.testing.assert_array_equal(a.data, b.data)


def test_parsed_once_per_process_and_again_once_changed(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write(path, 10, seed=0)
    first = open_gguf(str(path))
    assert open_gguf(str(path)) is first
    _write(path, 20, seed=1)  # a new file at the same path (size and mtime differ)
    second = open_gguf(str(path))
    assert second is not first
    assert len(second.fields["tokenizer.ggml.tokens"].data) == 20
