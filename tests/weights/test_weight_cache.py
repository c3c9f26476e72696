"""The weight cache (weights/weight_cache.py): a start that maps the kept SmolLM2 weights gets
the parameters of one that dequantizes the GGUF bit for bit (dtype, shape, strides, 64-byte
alignment), and so the same tokens and logprobs; the entry is written whole (a temporary file,
renamed), replaces an older entry of the same file and dtype, a damaged one or one of another
layout is rebuilt, and nothing is kept with KVRELAY_CACHE_DIR=off or above
KVRELAY_WEIGHT_CACHE_MAX_GB."""

from __future__ import annotations

import shutil

import pytest
import torch

from kvrelay.config import CacheConfig, EngineConfig
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams
from kvrelay.weights import gguf_reader, weight_cache
from kvrelay.weights.loader import build_model, resolve

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # a few short steps: threads only contend


@pytest.fixture(autouse=True)
def _entries_removed(tmp_path):
    """pytest keeps the last sessions' tmp_path: not their ~1 GB of entries."""
    yield
    shutil.rmtree(tmp_path / "weights", ignore_errors=True)


def _never_dequantized(*args, **kwargs):
    raise AssertionError("a start that finds the entry must not read the GGUF's tensors")


def _same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        x, y = sa[name], sb[name]
        assert (x.dtype, x.shape, x.stride()) == (y.dtype, y.shape, y.stride()), name
        assert x.data_ptr() % 64 == y.data_ptr() % 64 == 0, name
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name  # bits, NaNs too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mapped_weights_equal_the_dequantized_ones_bit_for_bit(tmp_path, monkeypatch, dtype):
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))
    src = resolve("smollm2")
    built = build_model(src, dtype, CPU)  # dequantizes, then writes the entry
    entries = list((tmp_path / "weights").iterdir())
    assert [p.suffix for p in entries] == [".pt"]  # one entry, no temporary file left
    monkeypatch.setattr(gguf_reader, "read_weights", _never_dequantized)
    mapped = build_model(src, dtype, CPU)
    _same_parameters(built, mapped)


def test_an_engine_on_mapped_weights_gives_the_same_tokens_and_logprobs(tmp_path, monkeypatch):
    cfg = EngineConfig(cache=CacheConfig(max_total_tokens=1024))
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356], [1, 4093, 198, 6004, 665, 2, 198, 1, 520]]

    def run() -> list:
        outs = generate(Engine(cfg), prompts, greedy)
        return [[(o.token_ids, o.logprobs, o.top_logprobs) for o in seq] for seq in outs]

    monkeypatch.setenv("KVRELAY_CACHE_DIR", "off")
    dequantized = run()
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))
    build_model(resolve("smollm2"), torch.float32, CPU)  # writes the entry
    monkeypatch.setattr(gguf_reader, "read_weights", _never_dequantized)
    assert run() == dequantized


def test_entries_replace_older_ones_rebuild_damaged_ones_and_respect_off_and_the_bound(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))
    src = resolve("smollm2")
    path = weight_cache.entry_path(src.path, torch.bfloat16, 1)
    stem = path.name.split("-")[0]
    path.parent.mkdir(parents=True)
    older = path.parent / f"{stem}-0000000000000000.pt"  # the same file and dtype, other code
    older.write_bytes(b"an entry of an earlier version")
    other = path.parent / "ffffffffffffffff-0000000000000000.pt"  # another model or dtype
    other.write_bytes(b"kept")
    path.write_bytes(b"damaged: not a torch file")
    assert weight_cache.load(path, CPU) is None
    build_model(src, torch.bfloat16, CPU)  # dequantizes and rewrites the damaged entry
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, other.name])
    assert weight_cache.load(path, CPU) is not None

    # An entry of another layout (names or shapes; a change in layers/) is rebuilt, not fatal.
    torch.save({"model.norm.weight": torch.zeros(3, dtype=torch.bfloat16)}, path)
    build_model(src, torch.bfloat16, CPU)
    assert weight_cache.load(path, CPU)["model.norm.weight"].shape == (576,)

    monkeypatch.setenv("KVRELAY_WEIGHT_CACHE_MAX_GB", "0.1")  # SmolLM2 in bf16 is 0.25 GiB
    assert weight_cache.entry_path(src.path, torch.bfloat16, 135_000_000 * 2) is None
    monkeypatch.setenv("KVRELAY_WEIGHT_CACHE_MAX_GB", "4")
    monkeypatch.setenv("KVRELAY_CACHE_DIR", "off")
    assert weight_cache.entry_path(src.path, torch.bfloat16, 1) is None
