"""CUDA IPC sharing of cache tensors between processes, and the GPU checksum."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from kvrelay.disagg.transport.cuda_ipc import device_checksum, export_tensors, open_tensors

pytestmark = pytest.mark.gpu


def _writer(blob: bytes, rows: list[int], q) -> None:
    """Another process: open the peer's pool and write rows into it, like prefill does."""
    peer = open_tensors(blob)["pool"]
    src = torch.arange(len(rows) * peer.shape[1], device="cuda", dtype=peer.dtype)
    src = src.view(len(rows), -1)
    peer[torch.tensor(rows, device="cuda")] = src
    torch.cuda.synchronize()
    q.put(device_checksum(src))


def test_a_peer_process_writes_into_exported_pages() -> None:
    pool = torch.zeros(16, 8, 64, dtype=torch.bfloat16, device="cuda")
    view = pool[:, 2]  # a strided view, like one layer of a shared buffer
    rows = [3, 7, 11]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_writer, args=(export_tensors({"pool": view}), rows, q))
    p.start()
    sent = q.get(timeout=120)
    p.join(60)
    assert p.exitcode == 0
    want = torch.arange(3 * 64, device="cuda", dtype=torch.bfloat16).view(3, 64)
    assert torch.equal(view[rows], want)
    assert device_checksum(view[rows]) == sent
    others = [r for r in range(16) if r not in rows]
    assert view[others].abs().sum() == 0 and pool[:, [0, 1, 3]].abs().sum() == 0


def test_checksum_sees_any_change_and_matches_the_cpu() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1000, 7, device="cuda", generator=g).to(torch.bfloat16)
    base = device_checksum(x)
    assert base == device_checksum(x.cpu())
    y = x.clone()
    y.view(torch.int16)[500, 3] ^= 1  # one bit
    assert device_checksum(y) != base
    z = x.clone()
    z[[10, 11]] = z[[11, 10]]  # two rows swapped: same bytes, other places
    assert device_checksum(z) != base


def test_descriptor_refuses_non_torch_objects() -> None:
    import pickle

    evil = pickle.dumps({"pool": (print, ("pwned",))})
    with pytest.raises(pickle.UnpicklingError):
        open_tensors(evil)
