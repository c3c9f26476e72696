"""A PD decode server with tensor parallel: rank 0 receives each KV piece from prefill and hands
it to every rank, which installs it into its own pool.

Only rank 0 talks to prefill (its receiver checks the piece: identity, size, checksum). It then
broadcasts the facts the rows derive from (cache kinds, pages, slot, token range, prompt length,
whether the window rows a later hit reads travel) and the payload, between two steps, on the
same channel as the steps (a header of kind INSTALL), so every rank sees installs and forwards
in the same order. Each rank computes the rows from its own cache kinds: DeepSeek-V4's pools
are the whole cache on every rank; a dense rank's kinds keep only its KV-head shard of each row
(`CacheKind.shard`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.cache.spec import CacheKind
from kvrelay.engine.kv_pieces import piece_rows, scatter
from kvrelay.layers.parallel import TPGroup

INSTALL = 2  # a step header kind (STOP = 0, STEP = 1 in tp_step, tp_gather.GATHER = 3)


@dataclass(frozen=True)
class PieceFacts:
    """The facts a piece's rows derive from (`piece_rows`): the same on every rank."""

    kinds: list[int]  # indices into the runner's transfer_layout()
    pages: list[int]
    slot: int
    start: int
    end: int
    prompt_len: int
    resume_rows: bool  # window rows a later hit reads too (decode caches the prompt's pages)

    def rows(
        self, layout: list[CacheKind], page_size: int
    ) -> tuple[list[CacheKind], list[torch.Tensor]]:
        """This rank's kinds of the piece and, per kind, its row indices."""
        ks = [layout[i] for i in self.kinds]
        s, e, n = self.start, self.end, self.prompt_len
        return ks, piece_rows(ks, self.pages, self.slot, page_size, s, e, n, self.resume_rows)


@dataclass(frozen=True)
class InstallPiece(PieceFacts):
    """A verified payload and the facts its rows derive from."""

    payload: memoryview | torch.Tensor | None  # None: every row range is empty


def install(kinds: list[CacheKind], page_size: int, p: InstallPiece) -> None:
    """Install the piece into this rank's pools."""
    scatter(*p.rows(kinds, page_size), p.payload)


def install_everywhere(
    tp: TPGroup, device: torch.device, header_len: int, kinds: list[CacheKind], page_size: int,
    p: InstallPiece,
) -> None:  # fmt: skip
    """Rank 0: hand the piece to the other ranks (if any), then install it here."""
    if tp.is_parallel:
        _send(tp, device, header_len, p)
    install(kinds, page_size, p)


def send_facts(
    tp: TPGroup, device: torch.device, header_len: int, kind: int, p: PieceFacts, nbytes: int = 0
) -> None:
    """Rank 0, between steps: a step header of `kind` (INSTALL, tp_gather.GATHER), the facts."""
    facts = [p.slot, p.start, p.end, p.prompt_len, int(p.resume_rows), len(p.kinds), *p.kinds]
    facts += p.pages
    head = [kind, len(facts), nbytes] + [0] * (header_len - 3)
    tp.broadcast(torch.tensor(head, dtype=torch.int64, device=device))
    tp.broadcast(torch.tensor(facts, dtype=torch.int64, device=device))


def recv_facts(tp: TPGroup, device: torch.device, head: list[int]) -> PieceFacts:
    """A follower, after a header `send_facts` sent: the facts."""
    facts = tp.broadcast(torch.empty(head[1], dtype=torch.int64, device=device)).tolist()
    slot, start, end, prompt_len, resume_rows, n_kinds = facts[:6]
    kinds, pages = facts[6 : 6 + n_kinds], facts[6 + n_kinds :]
    return PieceFacts(kinds, pages, slot, start, end, prompt_len, bool(resume_rows))


def _send(tp: TPGroup, device: torch.device, header_len: int, p: InstallPiece) -> None:
    nbytes = 0 if p.payload is None else p.payload.nbytes
    send_facts(tp, device, header_len, INSTALL, p, nbytes)
    if nbytes:
        buf = p.payload
        if not isinstance(buf, torch.Tensor):
            buf = torch.frombuffer(buf, dtype=torch.uint8)
        tp.broadcast(buf.to(device))


def recv(tp: TPGroup, device: torch.device, head: list[int]) -> InstallPiece:
    """A follower, after a header of kind INSTALL: the piece rank 0 sent."""
    f, nbytes = recv_facts(tp, device, head), head[2]
    payload = None
    if nbytes:
        payload = tp.broadcast(torch.empty(nbytes, dtype=torch.uint8, device=device))
    return InstallPiece(
        f.kinds, f.pages, f.slot, f.start, f.end, f.prompt_len, f.resume_rows, payload
    )
