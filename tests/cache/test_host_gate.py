"""The host tier's gate over real cache pools (dense K/V; DeepSeek-V4 with model-dtype and fp8
index keys), no model: no kind of a page can be read back from the host without the gate.

- the gate's kinds are the page kinds of the pool's cache spec; an independent walk over the
  pool's attributes (here, the oracle: a tensor the pool holds that its spec forgot is found)
  finds no other per-page tensor, and every other tensor the pool owns is per-request state
  (DeepSeek-V4's slots);
- a round trip: random bytes in the whole pool, pages offloaded, the whole pool poisoned, the
  host slots loaded into other pages through the gate: after `wait()` every per-page tensor
  the pool owns holds, bit for bit, what the offloaded pages held, each kind's copy was traced
  before the gate opened, and no per-request tensor was touched;
- the same round trip through a broken gate that skips any one kind fails (monkeypatch);
- the spec says which tensors are per page, so a pool with as many state slots as pages (or a
  dense pool of 2 pages, once one [2, layers, ...] buffer) gates exactly its page kinds.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvrelay.cache.host_gate import HostTierGate, page_tensors
from kvrelay.cache.kv_pool import KVPool, kv_cache_spec
from kvrelay.models.deepseek_v4.cache_pool import DeepseekV4CachePool
from kvrelay.weights.loader import resolve

CPU = torch.device("cpu")
PAGES, SLOTS = 6, 3


def owned_tensors(pool) -> dict[str, torch.Tensor]:
    """Every tensor reachable from the pool's attributes (through lists, tuples, dicts and
    kvrelay's own objects), by the attribute path first reaching it: the oracle the spec is
    checked against, not how the gate finds its kinds."""
    found: dict[tuple, tuple[str, torch.Tensor]] = {}
    seen: set[int] = set()

    def walk(obj, path: str) -> None:
        if isinstance(obj, torch.Tensor):
            key = (obj.data_ptr(), tuple(obj.shape), obj.stride(), obj.dtype)
            found.setdefault(key, (path, obj))
            return
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}[{k}]")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}[{i}]")
        elif type(obj).__module__.startswith(("kvrelay.cache", "kvrelay.models.deepseek_v4")):
            items = (
                {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
                if dataclasses.is_dataclass(obj)
                else vars(obj)
            )
            for k, v in items.items():
                walk(v, f"{path}.{k}" if path else k)

    walk({k: v for k, v in vars(pool).items() if k != "cfg"}, "")
    return dict(found.values())


def _dense(pages: int) -> KVPool:
    c = resolve("smollm2").config
    return KVPool(
        kv_cache_spec(c.num_layers, c.num_kv_heads, c.head_dim, 4, torch.float32), pages, CPU
    )


def _pool(kind: str):
    if kind == "dense":
        return _dense(PAGES)
    cfg = resolve("dsv4-tiny", "dummy").config
    index_k = "fp8" if kind == "dsv4-fp8" else "auto"
    return DeepseekV4CachePool(cfg, PAGES, 16, SLOTS, torch.float32, CPU, index_k)


POOLS = ["dense", "dsv4", "dsv4-fp8"]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _fill(pool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in owned_tensors(pool).values():
        _bytes(t).copy_(torch.randint(0, 256, _bytes(t).shape, generator=g, dtype=torch.uint8))


def round_trip(pool, gate: HostTierGate) -> None:
    """Offload pages 1, 2 to host slots 1, 2, poison the pool, load them into pages 4, 3; raises
    AssertionError unless every per-page tensor the pool owns came back through the gate."""
    _fill(pool, 0)
    owned = owned_tensors(pool)
    per_page = {n: t for n, t in owned.items() if t.dim() and t.shape[0] == pool.num_pages}
    want = {n: (_bytes(t[1]).clone(), _bytes(t[2]).clone()) for n, t in per_page.items()}
    gate.copy_out([(1, 1), (2, 2)])
    gate.wait()
    _fill(pool, 1)  # the device pages are reused: whatever was there is gone
    paged = {t.untyped_storage().data_ptr() for t in per_page.values()}
    state = {
        n: _bytes(t).clone()
        for n, t in owned.items()
        if t.untyped_storage().data_ptr() not in paged  # per-request state
    }
    gate.trace = []
    gate.copy_in([(1, 4), (2, 3)])
    gate.wait()
    wrong = [n for n, t in per_page.items() if not torch.equal(_bytes(t[4]), want[n][0])]
    wrong += [n for n, t in per_page.items() if not torch.equal(_bytes(t[3]), want[n][1])]
    assert not wrong, f"loaded without the gate: {wrong}"
    assert all(torch.equal(_bytes(owned[n]), b) for n, b in state.items()), "state touched"
    opened = gate.trace.index(("open", ""))
    assert {k for way, k in gate.trace[:opened] if way == "in"} == set(gate.kinds)


@pytest.mark.parametrize("kind", POOLS)
def test_the_gate_moves_every_per_page_tensor_the_pool_owns(kind: str) -> None:
    pool = _pool(kind)
    gate = HostTierGate(pool, 2, CPU)
    kinds = {t.untyped_storage().data_ptr() for t in gate.kinds.values()}
    for name, t in owned_tensors(pool).items():  # the rest is per-request state
        assert t.untyped_storage().data_ptr() in kinds or t.shape[0] == SLOTS, name
    if kind != "dense":  # every DeepSeek-V4 kind: window, c4/c16 KV, index keys, page_prev
        names = " ".join(gate.kinds)
        for part in ("swa_kv", "c4_kv", "c16_kv", "index_k ", "page_prev_kv", "page_prev_score"):
            assert part in names + " "
        assert ("index_k_scale" in names) == (kind == "dsv4-fp8")
    round_trip(pool, gate)
    gate.close()


@pytest.mark.parametrize("kind", POOLS)
def test_a_gate_that_skips_any_one_kind_fails_the_round_trip(kind: str, monkeypatch) -> None:
    pool = _pool(kind)
    kinds = list(page_tensors(pool))
    if kind == "dense":  # 60 alike kinds (each layer's K and V): K and V of a few layers
        kinds = kinds[:2] + kinds[29:31] + kinds[-2:]
    for skipped in kinds:
        gate = HostTierGate(pool, 2, CPU)
        monkeypatch.delitem(gate.kinds, skipped)  # as a hand-kept list that forgot one would
        with pytest.raises(AssertionError, match="loaded without the gate"):
            round_trip(pool, gate)
        gate.close()


def test_the_spec_says_which_tensors_are_per_page() -> None:
    """Shapes alone would be ambiguous here (reflection refused these pools); the spec is not."""
    cfg = resolve("dsv4-tiny", "dummy").config
    pool = DeepseekV4CachePool(cfg, 4, 16, 4, torch.float32, CPU)  # as many slots as pages
    assert set(page_tensors(pool)) == {k.name for k in pool.spec.kinds if k.unit == "page"}
    assert not any(
        ".pending_" in n or n.endswith((".prev_kv", ".prev_score")) for n in page_tensors(pool)
    )
    dense = _dense(2)  # 2 pages
    assert list(page_tensors(dense)) == [
        f"L{i}.{n}" for i in range(len(dense.layers)) for n in "kv"
    ]
