"""`kvrelay repro` judging: is one turn corrupt, compared with the reference's reply to the same
request, and the counts of one concurrency level.

A turn is corrupt when it diverges from the reference beyond a near-tie, or when a detector finds,
in the part of the turn that matches the reference token for token (all of it when nothing
diverged), something the reference reply does not have. After a near-tie divergence the rest of
the turn is different text, legitimately: what the detectors find there (a small model's loop) is
its habit, not damage, and is reported as "after a near-tie" without being counted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvrelay.bench import repro_sessions as sessions
from kvrelay.bench.detectors import DETECTORS, Finding, Reply, detect
from kvrelay.bench.metrics import failure_report
from kvrelay.bench.repro_report import wilson
from kvrelay.bench.verify import Comparison, Output, compare, divergence_histogram


@dataclass
class Turn:
    """One request of a session and what came back."""

    body: dict  # the request without `model`
    output: Output  # text and logprob tokens, as verify compares them
    reply: Reply
    findings: list[Finding] = field(default_factory=list)
    cause: str | None = None  # failed: the HTTP status, "bad_response" or "exception:<type>"


@dataclass
class TurnVerdict:
    session: int
    turn: int
    comparison: Comparison | None  # None on error
    near_tie: bool = False  # diverged, but on a near-tie: the divergence is not counted
    new_findings: list[Finding] = field(default_factory=list)  # counted
    after_near_tie: list[Finding] = field(default_factory=list)  # reported, not counted
    error: str | None = None
    cause: str | None = None  # of the error (Turn.cause)

    @property
    def diverged(self) -> bool:
        return self.comparison is not None and not self.comparison.identical

    @property
    def corrupt(self) -> bool:
        return (self.diverged and not self.near_tie) or bool(self.new_findings)


def extra_findings(test: list[Finding], ref: list[Finding]) -> list[Finding]:
    """Findings of kinds the test has more of than the reference."""
    extra = Counter(f.detector for f in test) - Counter(f.detector for f in ref)
    return [f for f in test if extra[f.detector] > 0]


def matched_prefix_findings(test: Turn, pos: int, ignore_eos: bool) -> list[Finding]:
    """The detectors on the test's first `pos` tokens (those equal to the reference's), read as a
    reply cut off there: a tag left open at the cut is not a defect."""
    toks = test.output.tokens[:pos]
    cut = Reply(content="".join(toks), tokens=toks, finish_reason="length")
    return detect(cut, sessions.SCHEMAS, ignore_eos)


def judge_turn(
    session: int,
    k: int,
    ref: Turn,
    test: Turn | None,
    near_tie: float,
    ignore_eos: bool = False,
) -> TurnVerdict:
    if test is None:
        return TurnVerdict(session, k, None, error="not run", cause="not_run")
    if test.output.error:
        return TurnVerdict(session, k, None, error=test.output.error, cause=test.cause)
    c = compare(k, ref.output, test.output, near_tie)
    extra = extra_findings(test.findings, ref.findings)
    # Same token strings but different text (detokenisation) is no near-tie, whatever the gap.
    tie = bool(c.near_tie and c.b_token_in_ref_top and c.a_token != c.b_token)
    if c.identical or not tie:
        # Same tokens: every finding the reference lacks is damage (e.g. a different parse).
        # A real divergence: corrupt anyway; its findings show what the damage looks like.
        return TurnVerdict(session, k, c, new_findings=extra)
    pos = c.first_divergence or 0
    before = extra_findings(matched_prefix_findings(test, pos, ignore_eos), ref.findings)
    counted = Counter(f.detector for f in before)
    after = [f for f in extra if counted[f.detector] == 0]
    return TurnVerdict(session, k, c, near_tie=True, new_findings=before, after_near_tie=after)


def judge_level(
    concurrency: int,
    reference: list[list[Turn]],
    tested: list[list[Turn]],
    secs: float,
    near_tie: float,
    ignore_eos: bool = False,
) -> tuple[dict, list[TurnVerdict]]:
    verdicts: list[TurnVerdict] = []
    corrupt = clean = incomplete = 0
    for s, (ref, test) in enumerate(zip(reference, tested, strict=True)):
        vs = [
            judge_turn(s, k, r, test[k] if k < len(test) else None, near_tie, ignore_eos)
            for k, r in enumerate(ref)
            if not r.output.error
        ]
        verdicts += vs
        if any(v.corrupt for v in vs):
            corrupt += 1
        elif any(v.error for v in vs) or any(r.output.error for r in ref):
            incomplete += 1  # nothing wrong seen, but not all of it could be compared
        else:
            clean += 1
    compared = corrupt + clean
    counted = [v for v in verdicts if v.diverged and not v.near_tie]
    detectors = Counter(f.detector for v in verdicts for f in v.new_findings)
    after = Counter(f.detector for v in verdicts for f in v.after_near_tie)
    level = {
        "concurrency": concurrency,
        "sessions": len(reference),
        "compared": compared,
        "corrupted": corrupt,
        "incomplete": incomplete,
        "rate": corrupt / compared if compared else 0.0,
        "ci95": list(wilson(corrupt, compared)),
        "turns": len(verdicts),
        "divergent_turns": len(counted),
        "near_tie_turns": sum(1 for v in verdicts if v.near_tie),
        "failed_requests": sum(1 for v in verdicts if v.error),
        # Why they failed: a histogram of causes, and the first failures word for word.
        **failure_report(
            [
                (v.cause, v.error, {"session": v.session, "turn": v.turn})
                for v in verdicts
                if v.error
            ]
        ),
        "detectors": {d: detectors[d] for d in DETECTORS},
        # Findings after a near-tie divergence: the model's habits on other text, not counted.
        "after_near_tie": {d: after[d] for d in DETECTORS},
        "after_near_tie_turns": sum(1 for v in verdicts if v.after_near_tie),
        "corrupted_sessions": sorted({v.session for v in verdicts if v.corrupt}),
        # [session, turn, first divergent token] of every counted divergence
        "divergences": [[v.session, v.turn, v.comparison.first_divergence] for v in counted],
        "divergence_histogram": divergence_histogram(
            [v.comparison.first_divergence for v in counted]
        ),
        "duration_s": secs,
        "output_tokens": sum(len(t.output.tokens) for ts in tested for t in ts),
    }
    return level, verdicts
