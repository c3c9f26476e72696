"""Which drafts a decoding request verifies this step (`--speculative-algorithm ngram`), which
model families and requests may speculate, and the acceptance counters /metrics shows.

A request drafts only where verifying the drafts gives exactly what plain decoding would: it
decodes (its prompt is computed and it has an output), it has no grammar (a constrained request
decodes plainly: its matcher would have to verify every drafted row), and the drafts stay within
its max_tokens and the context (the last emitted token is the bonus or correction, so at most
`remaining - 1` drafts). Each request keeps its own n-gram index over prompt + output
(spec/ngram.py), extended with the tokens committed since the last proposal.
"""

from __future__ import annotations

from kvrelay.config import SpeculativeConfig
from kvrelay.engine.request import Request
from kvrelay.spec.ngram import NgramIndex

# The MTP block is trained to predict one token ahead; chained on its own output, each further
# draft is accepted less often (DeepSeek-V3 reports ~85-90% for the second token).
MAX_MTP_DRAFTS = 4


def check_supported(spec: SpeculativeConfig, family_name: str, family_cls) -> None:
    """Refuse (ValueError) a speculative configuration this engine cannot run exactly, before any
    weight is read. A family speculates only where its runner says how a rejected draft leaves
    no trace (`speculation`, models/base.py): dense KV pages and DeepSeek-V4's state slots
    alike are overwritten later ("overwrite")."""
    if spec.algorithm == "none":
        return
    if spec.algorithm not in ("ngram", "mtp"):
        raise ValueError(f"unknown --speculative-algorithm {spec.algorithm!r} (none | ngram | mtp)")
    if spec.algorithm == "mtp" and not getattr(family_cls, "drafts_with_mtp", False):
        raise ValueError(
            f"--speculative-algorithm mtp needs a model with an MTP block (DeepSeek-V4); "
            f"{family_name} has none (use ngram)"
        )
    if getattr(family_cls, "speculation", "") != "overwrite":
        raise ValueError(
            f"--speculative-algorithm {spec.algorithm} is not supported for {family_name} models "
            "yet (a rejected draft would stay in their per-request state); serve without it"
        )
    if spec.num_draft_tokens < 1:
        raise ValueError("--speculative-num-draft-tokens must be at least 1")
    if spec.disable_batch_size < 0:
        raise ValueError("--speculative-disable-batch-size must be 0 (never) or more")
    if spec.algorithm == "ngram":
        NgramIndex(spec.ngram_min, spec.ngram_max)  # raises on bad window sizes
    elif spec.num_draft_tokens > MAX_MTP_DRAFTS:
        raise ValueError(
            f"--speculative-algorithm mtp chains its block at most {MAX_MTP_DRAFTS} times: "
            f"--speculative-num-draft-tokens 1..{MAX_MTP_DRAFTS}"
        )


class SpecStats:
    """Totals since start: verify steps with drafts, drafted and accepted tokens, and how often
    the draft at each position was accepted (vLLM's names)."""

    def __init__(self, k: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def as_dict(self) -> dict[str, int]:
        d = {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
        }
        d.update({f"accepted_pos_{i}": n for i, n in enumerate(self.accepted_per_pos)})
        return d


def draft_room(req: Request, k: int, budget: int, max_model_len: int) -> int:
    """How many drafts req may verify this step: the bonus token is emitted too, so drafts + 1
    within max_tokens and the context; within the step budget; and at most K."""
    return min(k, budget, req.remaining_max_tokens - 1, max_model_len - 1 - req.num_tokens)


class NgramDrafter:
    def __init__(self, spec: SpeculativeConfig, max_model_len: int) -> None:
        self.k = spec.num_draft_tokens
        self.min_n, self.max_n = spec.ngram_min, spec.ngram_max
        self.max_model_len = max_model_len
        self.stats = SpecStats(self.k)

    def propose(self, req: Request, budget: int) -> list[int]:
        """Up to min(K, budget) drafts for req's next step; [] when it decodes plainly."""
        if req.matcher is not None or not req.output_ids:
            return []
        room = draft_room(req, self.k, budget, self.max_model_len)
        if room <= 0:
            return []
        index = req.draft_index
        if index is None:
            index = req.draft_index = NgramIndex(self.min_n, self.max_n)
        n = len(index.tokens)
        index.extend(req.token_slice(n, req.num_tokens))
        return index.propose(room)


class MtpDrafter:
    """The draft the model's MTP block made for a request after its last step (the family's
    `propose_drafts`, models/base.py), while it still applies: made when the request had as
    many tokens as now."""

    def __init__(self, spec: SpeculativeConfig, max_model_len: int) -> None:
        self.k = spec.num_draft_tokens
        self.max_model_len = max_model_len
        self.stats = SpecStats(self.k)

    def propose(self, req: Request, budget: int) -> list[int]:
        if req.matcher is not None or not req.output_ids or req.mtp_draft_at != req.num_tokens:
            return []
        return req.mtp_draft[: max(draft_room(req, self.k, budget, self.max_model_len), 0)]


def make_drafter(
    spec: SpeculativeConfig, max_model_len: int, role: str
) -> NgramDrafter | MtpDrafter | None:
    """The engine's drafter, or None (off; a PD prefill server makes one token per request)."""
    if spec.algorithm == "none" or role == "prefill":
        return None
    if spec.algorithm == "mtp":
        return MtpDrafter(spec, max_model_len)
    return NgramDrafter(spec, max_model_len)
