"""The engine loop body: take requests, schedule, forward, sample, emit."""

from __future__ import annotations

import logging
import random
import time

import msgspec
import torch

from kvrelay.cache.host_tier import HostTier, build_host_tier
from kvrelay.config import EngineConfig
from kvrelay.engine import grammar as grammar_mod
from kvrelay.engine.drafter import make_drafter
from kvrelay.engine.faults import engine_faults
from kvrelay.engine.grammar import GrammarBackend, GrammarError
from kvrelay.engine.messages import AddRequest, EngineStats, RequestOutput, StepOutputs
from kvrelay.engine.pd_connector import AgentFactory, PDAgent
from kvrelay.engine.pd_sides import EngineSchedulerSide, RunnerWorkerSide
from kvrelay.engine.request import Request, Status
from kvrelay.engine.runner import make_runner
from kvrelay.engine.sampler import sample
from kvrelay.engine.scheduler import ScheduledRequest, Scheduler
from kvrelay.engine.step_budget import PrefillBudget
from kvrelay.engine.verify import Emitted, sample_verify
from kvrelay.layers.step_profile import COMMUNICATION, StepProfiler, timed
from kvrelay.models import registry
from kvrelay.weights.loader import ModelSource, resolve

log = logging.getLogger("kvrelay.engine")


class Engine:
    def __init__(
        self, cfg: EngineConfig, src: ModelSource | None = None,
        make_agent: AgentFactory | None = None,
    ) -> None:  # fmt: skip
        """`make_agent`: builds a PD role's transfer agent (kvrelay.disagg.connector.make_agent);
        a prefill or decode engine needs it, a single one ignores it."""
        self.cfg = cfg
        self.src = src or resolve(cfg.model, cfg.load_format, cfg.tokenizer)
        self.runner = make_runner(cfg, self.src)
        r = self.runner
        self.prefix_cache = self._prefix_cache_choice()
        self.host_tier, host = self._host_tier_choice()
        sc = cfg.scheduler
        self.prefill_budget = (
            PrefillBudget(sc.max_decode_slowdown, r.page_size, sc.max_num_batched_tokens)
            if sc.max_decode_slowdown
            else None
        )
        self.drafter = make_drafter(cfg.speculative, r.max_model_len, cfg.role)
        self.scheduler = Scheduler(
            sc, r.num_pages, r.page_size, r.num_state_slots,
            self.prefix_cache == "on", self.host_tier, self.prefill_budget,
            self.drafter.propose if self.drafter is not None else None,
            cfg.speculative.disable_batch_size,
        )  # fmt: skip
        log.info(
            "prefix_cache=%s host_tier=%s role=%s speculative=%s", self.prefix_cache, host,
            cfg.role, self._speculative_choice(),
        )  # fmt: skip
        self.eos_ids = set(self.src.config.eos_token_ids)
        self.eos_tuple = tuple(sorted(self.eos_ids))  # the sampler's min_tokens mask
        self.grammar = GrammarBackend(
            self.src, self.src.config.vocab_size, sorted(self.eos_ids)
        )  # llguidance: built on the first grammar-constrained request
        self._rng = random.Random(cfg.seed)
        # TEST ONLY (engine/faults.py): None unless a fault flag is set
        self.faults = engine_faults(cfg, self._rng, self.src.config.vocab_size)
        self._pending: list[RequestOutput] = []
        self.last_step_ms = 0.0
        self.profiler = StepProfiler(self.runner.device)
        self.profile_every = cfg.step_profile_every  # 0: no step is profiled
        self._batch_steps = 0  # steps that ran a batch, for profile_every
        self.failed_steps = 0  # batch steps in a row whose forward raised
        self.agent: PDAgent | None = None  # PD transfer agent (prefill: sender, decode: receiver)
        if cfg.role in ("prefill", "decode"):
            if make_agent is None:
                raise ValueError(
                    f"a {cfg.role} engine needs make_agent (kvrelay.disagg.connector.make_agent)"
                )
            self.agent = make_agent(cfg, EngineSchedulerSide(self), RunnerWorkerSide(self))

    def _prefix_cache_choice(self) -> str:
        """'on', or why the prefix cache is off."""
        if not self.cfg.cache.prefix_cache:
            return "off (--disable-prefix-cache)"
        if not registry.family(self.src.config.architecture).prefix_cache:
            return "off (not supported for this model family yet)"
        # A PD decode caches what it receives too (DeepSeek-V4 included: the per-page compressor
        # state travels as a cache kind, and a hit never ends on a received page that lacks the
        # rows a request resuming there reads).
        if self.cfg.tensor_parallel_size > 1 and self.runner.num_state_slots:
            # A hit restores the request's state slot (DeepSeek-V4's compressor state) from its
            # last shared page on rank 0 only; the other ranks' slots would miss it.
            return "off (per-request state with tensor parallel)"
        return "on"

    def _speculative_choice(self) -> str:
        sp = self.cfg.speculative
        if self.drafter is None:
            return "off" if sp.algorithm == "none" else f"off ({self.cfg.role} role)"
        return f"{sp.algorithm} k={sp.num_draft_tokens} n={sp.ngram_min}..{sp.ngram_max}"

    def _sample(self, logits: torch.Tensor, chosen: list[ScheduledRequest]) -> list[Emitted]:
        """Each sampling request's tokens of this step: one, or with drafts the accepted ones
        and the bonus (or correction) token (verify.py)."""
        reqs = [s.req for s in chosen]
        if not any(s.draft for s in chosen):
            result = sample(
                logits,
                [r.params for r in reqs],
                [r.output_ids for r in reqs],
                [r.generator for r in reqs],
                self.grammar.bitmask(reqs),  # None when no request is constrained
                self.cfg.deterministic,
                self.eos_tuple,
            )
            return [
                Emitted([t], [lp], [top], 0)
                for t, lp, top in zip(
                    result.token_ids, result.logprobs, result.top_logprobs, strict=True
                )
            ]
        rows = [s.req for s in chosen for _ in range(len(s.draft) + 1)]
        bitmask = self.grammar.bitmask(rows)  # a constrained request never drafts: one row
        return sample_verify(logits, chosen, bitmask, self.cfg.deterministic, self.eos_tuple)

    def _host_tier_choice(self) -> tuple[HostTier | None, str]:
        """The prefix cache's host tier, or None; and what was decided."""
        if self.prefix_cache != "on":
            return None, "off (no prefix cache)"
        if self.cfg.tensor_parallel_size > 1:  # rank 0 alone would move its pages
            return None, "off (tensor parallel)"
        if self.cfg.role == "decode":
            # Transferred KV is installed outside the step, past the copy gate: a page just
            # offloaded could be rewritten before its copy is done.
            return None, "off (PD decode role)"
        return build_host_tier(self.runner.pool, self.cfg.cache.host_cache_gb, self.runner.device)

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def add(self, msg: AddRequest) -> None:
        p = msg.params
        error = None
        if not msg.prompt_ids:
            error = "prompt is empty"
        elif len(msg.prompt_ids) + p.max_tokens > self.max_model_len:
            error = (
                f"prompt ({len(msg.prompt_ids)} tokens) + max_tokens ({p.max_tokens}) exceeds the "
                f"maximum context length {self.max_model_len}"
            )
        elif p.max_tokens < 0:
            error = "max_tokens must not be negative (0: prefill only, e.g. for prompt logprobs)"
        elif max(msg.prompt_ids) >= self.src.config.vocab_size or min(msg.prompt_ids) < 0:
            error = "prompt contains token ids outside the vocabulary"
        elif msg.pd is not None and msg.pd.role != self.cfg.role:
            error = f"this server's role is {self.cfg.role}; it cannot take a {msg.pd.role} request"
        elif p.prompt_logprobs is not None and self.cfg.tensor_parallel_size > 1:
            error = (
                "prompt logprobs (echo with logprobs, prompt_logprobs) are not supported with "
                "tensor parallel yet"
            )
        elif msg.pd is not None and p.max_tokens < 1:
            error = "max_tokens 0 is not a PD request (the router sends it to prefill alone)"
        elif msg.pd is not None and msg.pd.role != "prefill" and p.prompt_logprobs is not None:
            # Prefill runs the prompt and scores it (the router merges its scores into decode's
            # answer); decode never runs it.
            error = "prompt logprobs are computed by the PD prefill server, not decode"
        if error:
            self._pending.append(RequestOutput(msg.rid, [], finish_reason="rejected", error=error))
            if msg.pd is not None and self.agent is not None:
                self.agent.reject(
                    msg.pd.transfer_id, error
                )  # the peer learns now, not at a timeout
            return
        req = Request(msg.rid, msg.prompt_ids, p, 0)
        req.group = msg.group
        if p.grammar is not None:
            try:
                req.matcher = self.grammar.matcher(p.grammar)
            except Exception as e:  # GrammarError, or llguidance failing: this request only
                if not isinstance(e, GrammarError):
                    log.exception("grammar setup failed rid=%s", msg.rid)
                    e = GrammarError(f"the grammar cannot be used: {type(e).__name__}: {e}")
                self._pending.append(
                    RequestOutput(msg.rid, [], finish_reason="rejected", error=str(e))
                )
                if msg.pd is not None and self.agent is not None:
                    self.agent.reject(msg.pd.transfer_id, str(e))
                return
        req.generator = torch.Generator(device=self.runner.device)
        req.generator.manual_seed(p.seed if p.seed is not None else self._rng.getrandbits(63))
        if msg.pd is not None:
            if (
                msg.pd.role == "prefill"
            ):  # only the prompt's KV and the first token are computed here
                req.params = msgspec.structs.replace(p, max_tokens=1)
            self.agent.add(req, msg.pd)
            return
        self.scheduler.add(req)

    def abort(self, rid: str) -> None:
        req = self.scheduler.find(rid)
        held = self.agent is not None and self.agent.abort(rid)
        if req is not None:
            self.scheduler.finish(req, "abort")
        if req is not None or held:
            self._pending.append(RequestOutput(rid, [], finish_reason="abort"))

    def emit(self, out: RequestOutput) -> None:
        """Queue an output for the next step's batch of outputs (used by the transfer agent)."""
        self._pending.append(out)

    def poll_transfers(self) -> None:
        if self.agent is not None:
            self.agent.poll()

    @property
    def transfers_in_flight(self) -> bool:
        return self.agent is not None and self.agent.in_flight

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._pending)

    def stats(
        self,
        batch_size: int = 0,
        num_tokens: int = 0,
        num_prefill: int = 0,
        components: dict[str, float] | None = None,
    ) -> EngineStats:
        a, prefix = self.scheduler.page_pool, self.scheduler.prefix
        cached = prefix.num_evictable if prefix is not None else 0
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.scheduler.siblings),  # n: held
            kv_pages_used=a.num_used - cached,  # pages the prefix cache alone holds count free
            kv_pages_total=a.num_usable,
            num_preemptions=self.scheduler.num_preemptions,
            step_ms=self.last_step_ms,
            batch_size=batch_size,
            num_tokens=num_tokens,
            num_prefill=num_prefill,
            components=components,
            failed_steps=self.failed_steps,
            spec_decode=None if self.drafter is None else self.drafter.stats.as_dict(),
            prefix_cache=None
            if prefix is None
            else {
                "query_tokens": prefix.query_tokens,
                "hit_tokens": prefix.hit_tokens,
                "evicted_pages": prefix.evicted_pages,
                "cached_pages": prefix.num_pages,
                **(self.host_tier.stats() if self.host_tier is not None else {}),
            },
        )

    def _fail(self, req: Request, reason: str, error: str | None = None) -> None:
        self.scheduler.finish(req, reason)
        if self.agent is not None:
            self.agent.abort(req.rid)  # tells the PD peer; the error below is this request's answer
        self._pending.append(RequestOutput(req.rid, [], finish_reason=reason, error=error))

    def step(self) -> StepOutputs:
        t0 = time.perf_counter()
        batch, unfittable = self.scheduler.schedule()
        for req in unfittable:
            self._fail(req, "error", "the request does not fit in the KV cache")
        outputs, self._pending = self._pending, []
        if not batch:
            return StepOutputs(outputs, self.stats())
        # Prefill: a chunk of several tokens, or the first token of a request (step telemetry).
        num_prefill = sum(1 for s in batch if _known(s) > 1 or not s.req.output_ids)
        every, self._batch_steps = self.profile_every, self._batch_steps + 1
        profile = self.profiler if every > 0 and self._batch_steps % every == 0 else None
        try:
            if self.faults is not None:
                self.faults.before_forward(self._batch_steps)
            if self.host_tier is not None:  # the gate: host-tier copies land before any read
                self.host_tier.gate.wait()
            step = self.runner.forward_step(batch, profile)
            chosen = [s for s in batch if s.samples]
            sampling = [s.req for s in chosen]
            emitted = self._sample(step.logits, chosen)
        except Exception as e:  # a broken batch fails its requests, never the engine
            self.failed_steps += 1  # /health turns 503 when they keep failing (a sticky error)
            log.exception(
                "forward failed batch_size=%d failed_steps=%d", len(batch), self.failed_steps
            )
            for s in batch:
                self._fail(s.req, "error", f"internal error: {type(e).__name__}: {e}")
            outputs += self._pending
            self._pending = []
            self.last_step_ms = (time.perf_counter() - t0) * 1e3  # time lost counts too
            if profile is not None:
                profile.finish(self.last_step_ms)  # drops the broken step's regions
            return StepOutputs(outputs, self.stats())
        self.failed_steps = 0
        for req, entries in step.prompt:
            req.prompt_lp += entries
        self.scheduler.advance(batch)
        fault = self.faults is not None and self.faults.swaps(len(batch))
        for i, req in enumerate(sampling):
            prompt_lp = None
            if req.params.prompt_logprobs is not None and not req.output_ids:
                prompt_lp = req.prompt_lp  # complete: this step finished the prompt
            if req.params.max_tokens == 0:  # prefill only: the prompt's logprobs are the answer
                self.scheduler.finish(req, "length")
                outputs.append(
                    RequestOutput(
                        req.rid,
                        [],
                        finish_reason="length",
                        num_prompt_tokens=len(req.prompt_ids),
                        prompt_logprobs=prompt_lp,
                    )
                )
                continue
            self._commit(chosen[i], emitted[i], prompt_lp, fault, profile, outputs)
        if self.cfg.speculative.algorithm == "mtp":  # the model drafts from this step's rows
            follow = {s.req.rid: (_known(s) + em.accepted, em.tokens[-1])
                      for s, em in zip(chosen, emitted, strict=True)}  # fmt: skip
            wants = {s.req.rid for s in chosen if s.req.status == Status.RUNNING}
            self.runner.propose_drafts(batch, follow, wants)
        self.last_step_ms = (time.perf_counter() - t0) * 1e3
        num_tokens = sum(s.num_new_tokens for s in batch)
        split = None if profile is None else profile.finish(self.last_step_ms)
        stats = self.stats(len(batch), num_tokens, num_prefill, split)
        if self.prefill_budget is not None:
            # Decode rows: one per decoding request, and its drafts (verified rows).
            decoding = sum(s.num_new_tokens for s in batch if _known(s) == 1 and s.req.output_ids)
            self.prefill_budget.observe(decoding, num_tokens - decoding, self.last_step_ms)
            stats.prefill_cap = self.prefill_budget.last_cap
        return StepOutputs(outputs, stats)

    def _commit(
        self, s: ScheduledRequest, em: Emitted, prompt_lp, fault: bool, profile,
        outputs: list[RequestOutput],
    ) -> None:  # fmt: skip
        """Append a sampling request's tokens of this step, one output each (as plain decoding
        sends them: the API process applies stop strings token by token, so nothing past a stop
        is emitted, counted or scored); a stop or the length inside an accepted span ends it."""
        req = s.req
        if s.draft and self.drafter is not None:
            self.drafter.stats.record(len(s.draft), em.accepted)
        for j, tok in enumerate(em.tokens):
            last = j == len(em.tokens) - 1
            # (only a span's last token: the KV of those before it is computed already)
            if fault and last:
                tok = self.faults.swap(tok)
            lp, top = em.logprobs[j], em.top_logprobs[j]
            out = RequestOutput(
                req.rid,
                [tok],
                logprobs=None if lp is None else [lp],
                top_logprobs=None if top is None else [top],
                num_prompt_tokens=len(req.prompt_ids),
                prompt_logprobs=prompt_lp if j == 0 else None,
                num_cached_tokens=req.num_cached_tokens,
            )
            if self.agent is not None and self.agent.role == "prefill":
                with timed(profile, COMMUNICATION):
                    shipped = self.agent.on_sampled(req, out)
                if shipped:
                    return  # sent to decode with the prompt's KV; decode continues from here
            req.output_ids.append(tok)
            reason = self.stop_reason(req, tok)
            if req.matcher is not None:
                verdict = grammar_mod.advance(req, tok)
                if verdict == "error":
                    self._fail(req, "error", f"grammar: {req.matcher.get_error()}")
                    return
                reason = reason or verdict  # a complete grammar ends the output
            out.finish_reason = reason
            if s.draft and (last or reason is not None):
                # Before finishing: the prefix cache takes only computed, accepted KV.
                self.scheduler.settle_verified(req)
            if reason is not None:
                self.scheduler.finish(req, reason)
            outputs.append(out)
            if reason is not None:
                return

    def stop_reason(self, req: Request, tok: int) -> str | None:
        """Why req stops after appending `tok` (None: it goes on); a transferred first token too."""
        p = req.params
        if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            return "stop"
        if len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def check_idle_integrity(self) -> None:
        """Every KV page and state slot is free or held by its owners exactly as counted."""
        self.scheduler.check_integrity()

    def flush_prefix_cache(self) -> int:
        """Evict every page only the prefix cache holds, host tier included; returns how many
        device pages (tests: an idle engine then holds no page at all)."""
        prefix = self.scheduler.prefix
        return 0 if prefix is None else prefix.flush()


def _known(s: ScheduledRequest) -> int:
    """The step's tokens of a scheduled request that are not drafts."""
    return s.num_new_tokens - len(s.draft)


def generate(
    engine: Engine, prompts: list[list[int]], params, steps: list[EngineStats] | None = None
) -> list[list[RequestOutput]]:
    """Run prompts to completion in one continuous batch (offline use: tests and benchmarks);
    `steps` collects the stats of every step that ran a batch."""
    rids = [f"offline-{i}" for i in range(len(prompts))]
    plist = params if isinstance(params, list) else [params] * len(prompts)
    for rid, ids, p in zip(rids, prompts, plist, strict=True):
        engine.add(AddRequest(rid, ids, p))
    per: dict[str, list[RequestOutput]] = {rid: [] for rid in rids}
    while engine.has_work:
        step = engine.step()
        if steps is not None and step.stats.batch_size:
            steps.append(step.stats)
        for out in step.outputs:
            per[out.rid].append(out)
    return [per[rid] for rid in rids]
