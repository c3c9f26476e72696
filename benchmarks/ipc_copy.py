"""The cuda_ipc transfer's data movement alone: another process's cache pages written through
CUDA IPC (what prefill does per chunk), against the device copy ceiling, plus the GPU checksum.

A decode-like process exports a paged pool (llama-1b KV shape: 16 layers x 2 x [pages, 16, 8,
64] bf16); a prefill-like process opens it and, per "request" of 1024 tokens, gathers its own
64 pages and index_copy_s them into 64 scattered pages of the peer pool, layer by layer, then
synchronises. Reports GB/s of KV moved (bytes written once), the same copy inside one process,
and `device_checksum`'s rate.

    python benchmarks/ipc_copy.py --out bench-results/ipc_copy.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time

import torch

from kvrelay.disagg import protocol as P
from kvrelay.disagg.transport.cuda_ipc import device_checksum, export_tensors, open_tensors

LAYERS, PAGES, PAGE, HEADS, DIM = 16, 4096, 16, 8, 64


def pool() -> list[torch.Tensor]:
    """Per layer and K/V: [pages, page * heads * dim] bytes, like a CacheKind's byte rows."""
    return [
        torch.zeros(PAGES, PAGE * HEADS * DIM * 2, dtype=torch.uint8, device="cuda")
        for _ in range(2 * LAYERS)
    ]


def copy_requests(src: list[torch.Tensor], dst: list[torch.Tensor], n: int, tokens: int):
    """n requests of `tokens` tokens: pages gathered from src, written to other pages of dst."""
    g = torch.Generator().manual_seed(0)
    per = tokens // PAGE
    plans = [
        (
            torch.randperm(PAGES, generator=g)[:per].cuda(),
            torch.randperm(PAGES, generator=g)[:per].cuda(),
        )
        for _ in range(n)
    ]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for s_rows, d_rows in plans:
        for s, d in zip(src, dst, strict=True):
            d.index_copy_(0, d_rows, s.index_select(0, s_rows))
        torch.cuda.synchronize()  # the sender syncs before each header
    dt = time.perf_counter() - t0
    nbytes = n * per * src[0].shape[1] * len(src)
    return nbytes / dt / 1e9, dt / n * 1e3


def writer(frame: bytes, args: dict, q) -> None:
    peer = open_tensors(P.decode(frame).ipc)  # the handles as they travel: decode's Auth frame
    dst = [peer[str(i)] for i in range(2 * LAYERS)]
    src = pool()
    for t in src:
        t.random_(0, 256)
    copy_requests(src, dst, 4, args["tokens"])  # warm-up
    q.put(copy_requests(src, dst, args["requests"], args["tokens"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    mine = pool()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(
        target=writer,
        args=(
            P.encode(P.Auth(b"", export_tensors({str(i): t for i, t in enumerate(mine)}))),
            vars(a),
            q,
        ),
    )
    proc.start()
    ipc_gbs, ipc_ms = q.get(timeout=300)
    proc.join(60)

    other = pool()
    copy_requests(mine, other, 4, a.tokens)
    local_gbs, local_ms = copy_requests(mine, other, a.requests, a.tokens)
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    big2 = torch.empty_like(big)
    big2.copy_(big)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        big2.copy_(big)
    torch.cuda.synchronize()
    ceiling = 10 * big.numel() / (time.perf_counter() - t0) / 1e9  # bytes copied (read + write: 2x)
    kv = mine[0][: a.tokens // PAGE].flatten()
    device_checksum(kv)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        device_checksum(torch.cat([t[: a.tokens // PAGE].flatten() for t in mine]))
    crc_ms = (time.perf_counter() - t0) / 20 * 1e3
    res = {
        "request_tokens": a.tokens,
        "request_kv_mib": a.tokens // PAGE * mine[0].shape[1] * len(mine) / 2**20,
        "ipc_gb_s": ipc_gbs,
        "ipc_ms_per_request": ipc_ms,
        "same_process_gb_s": local_gbs,
        "same_process_ms_per_request": local_ms,
        "copy_ceiling_gb_s": ceiling,
        "checksum_ms_per_request": crc_ms,
        "device": torch.cuda.get_device_name(),
    }
    for k, v in res.items():
        print(f"{k:>28}: {v:.3f}" if isinstance(v, float) else f"{k:>28}: {v}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
