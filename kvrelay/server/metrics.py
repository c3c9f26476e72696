"""Prometheus metrics of one server (own registry: several servers can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvrelay.engine.messages import StepOutputs

_LATENCY = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60, 120)
# An engine step: a graphed decode step of a small model takes ~1.5 ms, its parts 0.1-1 ms.
_STEP = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)
# A KV transfer: a short prompt over the GPU backend takes ~1 ms, a long one over TCP seconds.
_TRANSFER = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge(
            "kvrelay_num_requests_running", "requests in the running batch", registry=r
        )
        self.waiting = Gauge(
            "kvrelay_num_requests_waiting", "requests waiting for admission", registry=r
        )
        self.kv_usage = Gauge(
            "kvrelay_kv_cache_usage_ratio", "fraction of KV pages in use", registry=r
        )
        self.kv_used = Gauge("kvrelay_kv_pages_used", "KV pages in use", registry=r)
        self.preemptions = Gauge("kvrelay_num_preemptions", "requests preempted so far", registry=r)
        self.prompt_tokens = Counter("kvrelay_prompt_tokens", "prompt tokens processed", registry=r)
        self.generation_tokens = Counter(
            "kvrelay_generation_tokens", "tokens generated", registry=r
        )
        self.prefix_query_tokens = Counter(
            "kvrelay_prefix_cache_query_tokens",
            "tokens of admitted requests looked up in the prefix cache",
            registry=r,
        )
        self.prefix_hit_tokens = Counter(
            "kvrelay_prefix_cache_hit_tokens",
            "tokens found in the prefix cache (not computed again); hit rate = hit / query",
            registry=r,
        )
        self.prefix_evictions = Counter(
            "kvrelay_prefix_cache_evicted_pages",
            "KV pages the prefix cache evicted to make room",
            registry=r,
        )
        self.host_offloaded = Counter(
            "kvrelay_prefix_cache_host_offloaded_pages",
            "prefix-cache pages evicted from the device into the host tier",
            registry=r,
        )
        self.host_loaded = Counter(
            "kvrelay_prefix_cache_host_loaded_pages",
            "prefix-cache pages loaded back from the host tier for a hit",
            registry=r,
        )
        self.host_evicted = Counter(
            "kvrelay_prefix_cache_host_evicted_pages",
            "prefix-cache pages the host tier dropped to make room",
            registry=r,
        )
        self._prefix_seen: dict[str, int] = {}
        self.prefix_hit_rate = Gauge(
            "kvrelay_prefix_cache_hit_rate", "prefix cache hit tokens / query tokens", registry=r
        )
        self.prefix_pages = Gauge(
            "kvrelay_prefix_cache_pages", "KV pages the prefix cache holds", registry=r
        )
        self.host_pages = Gauge(
            "kvrelay_prefix_cache_host_pages",
            "pages the prefix cache's host tier holds",
            registry=r,
        )
        # Speculative decoding (vLLM's spec_decode names); mean accepted length per verify
        # step = 1 + accepted / drafts.
        self.spec_drafts = Counter(
            "kvrelay_spec_decode_num_drafts",
            "speculative decoding: request steps that verified drafts",
            registry=r,
        )
        self.spec_draft_tokens = Counter(
            "kvrelay_spec_decode_num_draft_tokens", "drafted tokens verified", registry=r
        )
        self.spec_accepted_tokens = Counter(
            "kvrelay_spec_decode_num_accepted_tokens", "drafted tokens accepted", registry=r
        )
        self.spec_accepted_per_pos = Counter(
            "kvrelay_spec_decode_num_accepted_tokens_per_pos",
            "drafted tokens accepted, by their position in the draft (0: the first)",
            ["position"],
            registry=r,
        )
        self._spec_seen: dict[str, int] = {}
        self.requests = Counter(
            "kvrelay_requests", "finished requests by finish reason", ["finish_reason"], registry=r
        )
        self.pd_failures = Counter(
            "kvrelay_pd_transfer_failures", "PD transfer failures by cause", ["cause"], registry=r
        )
        self._pd_failures_seen: dict[str, int] = {}  # the engine sends totals since its start
        self.pd_bytes = Counter(
            "kvrelay_pd_transfer_bytes",
            "PD KV bytes: sent (prefill) or installed (decode), by how they moved",
            ["direction", "backend"],
            registry=r,
        )
        self._pd_bytes_seen: dict[tuple[str, str], int] = {}
        self.pd_seconds = Histogram(
            "kvrelay_pd_transfer_seconds",
            "finished PD transfers: prefill transfer = reservation ack -> decode installed all, "
            "send = time sending pieces; decode transfer = reservation -> first token installed, "
            "install = time installing pieces",
            ["side", "phase"],
            buckets=_TRANSFER,
            registry=r,
        )
        self.pd_bootstrap = Counter(
            "kvrelay_pd_bootstrap_events",
            "PD peer events: peer_connected, peer_restarted, peer_lost, peer_silent, "
            "layout_mismatch, handshake_timeout, connect_failed, ipc_open_failed",
            ["event"],
            registry=r,
        )
        self._pd_bootstrap_seen: dict[str, int] = {}
        self.pd_transfers = Gauge(
            "kvrelay_pd_transfers", "PD transfers in flight by state", ["state"], registry=r
        )
        self.errors = Counter(
            "kvrelay_request_errors", "requests answered with an error", ["status"], registry=r
        )
        self.ttft = Histogram(
            "kvrelay_time_to_first_token_seconds", "TTFT", buckets=_LATENCY, registry=r
        )
        self.tpot = Histogram(
            "kvrelay_time_per_output_token_seconds", "TPOT", buckets=_LATENCY, registry=r
        )
        self.e2e = Histogram(
            "kvrelay_e2e_request_latency_seconds", "latency", buckets=_LATENCY, registry=r
        )
        self.step = Histogram(
            "kvrelay_engine_step_seconds", "engine step time", buckets=_STEP, registry=r
        )
        self.step_component = Histogram(
            "kvrelay_engine_step_component_seconds",
            "profiled engine steps (--step-profile-every): time per component",
            ["component"],
            buckets=_STEP,
            registry=r,
        )

    def on_step(self, msg: StepOutputs) -> None:
        s = msg.stats
        if s is None:
            return
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_used.set(s.kv_pages_used)
        self.kv_usage.set(s.kv_pages_used / max(s.kv_pages_total, 1))
        self.preemptions.set(s.num_preemptions)
        for state, n in (s.pd_transfers or {}).items():
            self.pd_transfers.labels(state=state).set(n)
        for cause, total in (s.pd_failures or {}).items():
            _add_new(self.pd_failures.labels(cause=cause), self._pd_failures_seen, cause, total)
        for direction, per_backend in (s.pd_bytes or {}).items():
            for backend, total in per_backend.items():
                counter = self.pd_bytes.labels(direction=direction, backend=backend)
                _add_new(counter, self._pd_bytes_seen, (direction, backend), total)
        for event, total in (s.pd_bootstrap or {}).items():
            _add_new(self.pd_bootstrap.labels(event=event), self._pd_bootstrap_seen, event, total)
        if s.prefix_cache is not None:
            p = s.prefix_cache
            for name, counter in (
                ("query_tokens", self.prefix_query_tokens),
                ("hit_tokens", self.prefix_hit_tokens),
                ("evicted_pages", self.prefix_evictions),
                ("host_offloaded_pages", self.host_offloaded),
                ("host_loaded_pages", self.host_loaded),
                ("host_evicted_pages", self.host_evicted),
            ):
                _add_new(counter, self._prefix_seen, name, p.get(name, 0))
            self.host_pages.set(p.get("host_pages", 0))
            self.prefix_hit_rate.set(p["hit_tokens"] / max(p["query_tokens"], 1))
            self.prefix_pages.set(p["cached_pages"])
        for name, total in (s.spec_decode or {}).items():
            if name.startswith("accepted_pos_"):
                counter = self.spec_accepted_per_pos.labels(position=name[len("accepted_pos_") :])
            else:
                counter = {
                    "num_drafts": self.spec_drafts,
                    "num_draft_tokens": self.spec_draft_tokens,
                    "num_accepted_tokens": self.spec_accepted_tokens,
                }[name]
            _add_new(counter, self._spec_seen, name, total)
        for side, phase, seconds in s.pd_timings or ():
            self.pd_seconds.labels(side=side, phase=phase).observe(seconds)
        if s.batch_size:
            self.step.observe(s.step_ms / 1e3)
        for component, ms in (s.components or {}).items():
            self.step_component.labels(component=component).observe(ms / 1e3)


def _add_new(counter: Counter, seen: dict, key, total: int) -> None:
    """The engine sends totals since its start: add what is new since the last stats."""
    new = total - seen.get(key, 0)
    if new > 0:
        counter.inc(new)
        seen[key] = total
