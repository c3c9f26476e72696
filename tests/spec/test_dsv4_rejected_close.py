"""A rejected draft that reached a compressor window, checked directly at the compress step
(the batched path's code with its torch reference, dsv4-tiny's CSA ratio-4 compressor with
overlap and its HCA ratio-16 one, float32 on CPU).

A verify step computes K = 4 drafts after the request's last token; some are rejected, and one
of those may close a window: it pools an entry, writes the next window's rows into the state
slot and replaces the prev halves an overlapping compressor keeps. The slot keeps two windows
(row = position % 2r, cache_pool.py), so none of that lands where the committed tokens read:
the next step, which starts at the first rejected position, computes bit for bit what it
computes after a step that had only the committed rows — its entries, and the slot rows any
later step reads. The rejected rows did change the slot (checked too), so the test would see a
layout that let them land on the wrong rows.
"""

from __future__ import annotations

import pytest
import torch

from kvrelay.config import EngineConfig
from kvrelay.engine.engine import Engine
from kvrelay.models.deepseek_v4.batch_meta import StepIndex, build_meta
from kvrelay.models.deepseek_v4.pooled_compressor import compress_step

K, PAGE, PAGES = 4, 16, 8
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def compressors() -> dict[int, torch.nn.Module]:
    cfg = EngineConfig(model="dsv4-tiny", load_format="dummy", device="cpu", dtype="float32")
    layers = Engine(cfg).runner.family.model.model.layers
    comps = [la.self_attn.compressor for la in layers if la.self_attn.compressor is not None]
    return {c.ratio: c for c in comps}


class Run:
    """One request's compressor state (slot 1; slot 0 the dummy) and entry pool, stepped."""

    def __init__(self, comp) -> None:
        r, d, coff = comp.ratio, comp.dim, comp.coff
        self.comp, self.r, self.d = comp, r, d
        self.pk, self.ps = torch.zeros(2, 2 * r, coff * d), torch.zeros(2, 2 * r, coff * d)
        self.prev = (torch.zeros(2, 2 * r, d), torch.zeros(2, 2 * r, d)) if comp.overlap else None
        pp = (torch.zeros(PAGES + 1, r, d), torch.zeros(PAGES + 1, r, d))
        self.page_prev = pp if comp.overlap else None
        self.entries = torch.zeros((PAGES + 1) * PAGE // r, d)
        self.stored: list[torch.Tensor] = []

    def step(self, start: int, kv: torch.Tensor, gate: torch.Tensor) -> None:
        pages = list(range(1, PAGES + 1))
        meta = build_meta([start], [kv.shape[0]], [pages], [1], (self.r,), PAGE, kv.device)
        index = StepIndex(meta, window=128)
        plan = index.compress_plan(self.r)
        cos_sin = index.rope(self.comp.rope, kv.dtype, plan.window_start)

        def store(rows: torch.Tensor, e: torch.Tensor) -> None:
            self.entries.index_copy_(0, rows, e)
            self.stored.append(e.clone())

        prev = self.prev or (None, None)
        compress_step(
            self.comp, kv, gate, meta, plan, cos_sin, self.pk, self.ps, *prev, store,
            page_prev=self.page_prev,
        )  # fmt: skip

    def slot(self) -> list[torch.Tensor]:
        return [t[1].clone() for t in (self.pk, self.ps, *(self.prev or ()))]


def _cases(r: int) -> list[tuple[int, int]]:
    """(tokens before the verify step, drafts accepted < K): every one whose rejected rows
    close a window of ratio r."""
    return [
        (s, a)
        for s in range(1, 3 * r)
        for a in range(K)
        if any((j + 1) % r == 0 for j in range(s + 1 + a, s + 1 + K))
    ]


@pytest.mark.parametrize("r", [4, 16])
def test_a_rejected_window_close_leaves_nothing_the_next_step_reads(compressors, r) -> None:
    comp = compressors[r]
    gen = torch.Generator().manual_seed(r)
    width = comp.coff * comp.dim
    cases = _cases(r)
    assert len(cases) > 2 * K
    for s, a in cases:
        kv, gate = (
            torch.randn(s + 24, width, generator=gen),
            torch.randn(s + 24, width, generator=gen),
        )
        junk = torch.randn(K, width, generator=gen), torch.randn(K, width, generator=gen)
        committed = s + 1 + a  # the verify step's rows s .. s + K: the last token and K drafts
        spec, plain = Run(comp), Run(comp)
        for run in (spec, plain):
            run.step(0, kv[:s], gate[:s])
        # the rejected drafts' rows: other tokens' projections (as a wrong draft gives)
        spec.step(
            s, *(torch.cat((x[s:committed], j[a:])) for x, j in zip((kv, gate), junk, strict=True))
        )
        plain.step(s, kv[s:committed], gate[s:committed])
        assert any(not torch.equal(x, y) for x, y in zip(spec.slot(), plain.slot(), strict=True)), (
            s,
            a,
        )
        spec.stored.clear(), plain.stored.clear()
        for run in (spec, plain):  # the next step starts at the first rejected position
            run.step(committed, kv[committed:], gate[committed:])
        assert len(spec.stored) == len(plain.stored) == 1
        assert torch.equal(spec.stored[0], plain.stored[0]), (s, a)
        assert torch.equal(spec.entries, plain.entries), (s, a)  # every window recomputed
        end = kv.shape[0]
        # what a step starting at `end` reads: the open window's rows, the last closed window's
        # first halves (the rows other steps write over before anyone reads them differ)
        w = end // r
        rows = [(w * r + i) % (2 * r) for i in range(end % r)]
        prev_rows = [((w - 1) * r + i) % (2 * r) for i in range(r)]
        wanted = (rows, rows, prev_rows, prev_rows)[: len(spec.slot())]
        for x, y, want in zip(spec.slot(), plain.slot(), wanted, strict=True):
            assert torch.equal(x[want], y[want]), (s, a)
        if comp.overlap:
            for x, y in zip(spec.page_prev, plain.page_prev, strict=True):
                assert torch.equal(x[1 : end // PAGE + 1], y[1 : end // PAGE + 1]), (s, a)
