"""CUDA IPC sharing of cache tensors between processes (the handles as typed fields, over the
wire encoding the agents use), the checks on a description, and the GPU checksum."""

from __future__ import annotations

import multiprocessing as mp

import msgspec
import pytest
import torch

from kvrelay.disagg import protocol as P
from kvrelay.disagg.transport.cuda_ipc import (
    IpcDescriptorError,
    device_checksum,
    export_tensors,
    open_tensors,
)

pytestmark = pytest.mark.gpu


def _writer(frame: bytes, rows: list[int], q) -> None:
    """Another process: decode decode's Auth frame, open its pool and write rows, like prefill."""
    peer = open_tensors(P.decode(frame).ipc)["pool"]
    src = torch.arange(len(rows) * peer.shape[1], device="cuda", dtype=peer.dtype)
    src = src.view(len(rows), -1)
    peer[torch.tensor(rows, device="cuda")] = src
    torch.cuda.synchronize()
    q.put(device_checksum(src))


def test_a_peer_process_writes_into_exported_pages() -> None:
    pool = torch.zeros(16, 8, 64, dtype=torch.bfloat16, device="cuda")
    view = pool[:, 2]  # a strided view, like one layer of a shared buffer
    rows = [3, 7, 11]
    (h,) = handles = export_tensors({"pool": view})
    assert (h.dtype, h.shape, h.stride) == ("bfloat16", [16, 64], [512, 1])
    assert h.storage_offset == 128 and h.storage_size_bytes == pool.numel() * 2
    frame = P.encode(P.Auth(b"\0" * 32, handles))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_writer, args=(frame, rows, q))
    p.start()
    sent = q.get(timeout=120)
    p.join(60)
    assert p.exitcode == 0
    want = torch.arange(3 * 64, device="cuda", dtype=torch.bfloat16).view(3, 64)
    assert torch.equal(view[rows], want)
    assert device_checksum(view[rows]) == sent
    others = [r for r in range(16) if r not in rows]
    assert view[others].abs().sum() == 0 and pool[:, [0, 1, 3]].abs().sum() == 0


def test_a_tampered_description_is_refused_before_it_is_opened() -> None:
    t = torch.zeros(16, 64, dtype=torch.uint8, device="cuda")
    (h,) = export_tensors({"pool": t})
    for bad in (
        msgspec.structs.replace(h, shape=[17, 64]),  # past the end of its storage
        msgspec.structs.replace(h, dtype="float32"),  # four times the bytes
        msgspec.structs.replace(h, dtype="torch.serialization.os.system"),
        msgspec.structs.replace(h, ref_counter_offset=10_000),
        msgspec.structs.replace(h, device=torch.cuda.device_count()),
    ):
        with pytest.raises(IpcDescriptorError):
            open_tensors([bad])


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
