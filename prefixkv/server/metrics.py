"""Prometheus metrics, named `prefixkv:...` like vLLM's `vllm:...` so the same dashboards carry over.

Two sources: latency histograms and finish-reason counts are observed per finished request (on the engine
thread, via AsyncEngine.on_finished); engine-wide state and totals (queues, pages, prefix-cache counters,
token counters) are read from Engine.get_stats() at scrape time by a custom collector. Each app gets its own
CollectorRegistry so several servers (or tests) in one process do not collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from prefixkv.cache_miss import CAUSES
from prefixkv.engine.metrics import EngineStats
from prefixkv.server.async_engine import FinishedRequest

_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class _EngineStatsCollector:
    """Yields gauges and counters from the latest EngineStats snapshot handed to it."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: EngineStats | None = None

    def collect(self):
        labels = ["model_name"]
        values = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        stats = self.stats
        if stats is None:
            return
        yield gauge("prefixkv:num_requests_running", "Requests in the running batch.", float(stats.num_running))
        yield gauge("prefixkv:num_requests_waiting", "Requests waiting to be scheduled.", float(stats.num_waiting))
        yield gauge(
            "prefixkv:kv_pages_used",
            "KV pages held by requests (cached-but-free pages excluded).",
            float(stats.num_pages_used),
        )
        yield gauge("prefixkv:kv_pages_total", "KV pages in the pool.", float(stats.num_pages_total))
        yield gauge(
            "prefixkv:kv_cache_usage_perc", "Fraction of KV pages held by requests (0-1).", float(stats.kv_usage)
        )
        yield gauge(
            "prefixkv:prefix_cache_cached_pages",
            "KV pages the prefix cache can serve a hit from (held by requests or evictable).",
            float(stats.num_cached_pages),
        )
        yield gauge(
            "prefixkv:prefix_cache_hit_rate",
            "Prefix-cache hits / queries, in tokens, over first admissions since start.",
            float(stats.prefix_cache_hit_rate),
        )
        yield counter(
            "prefixkv:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache at first admission.",
            float(stats.prefix_cache_queries),
        )
        yield counter(
            "prefixkv:prefix_cache_hits", "Prompt tokens served from the prefix cache.", float(stats.prefix_cache_hits)
        )
        yield counter(
            "prefixkv:prefix_cache_readmission_queries",
            "Prompt tokens looked up when a preempted request was admitted again (not in the hit rate).",
            float(stats.prefix_cache_readmission_queries),
        )
        yield counter(
            "prefixkv:prefix_cache_readmission_hits",
            "Of those, tokens served from the prefix cache.",
            float(stats.prefix_cache_readmission_hits),
        )
        missed = CounterMetricFamily(
            "prefixkv:prefix_cache_missed_tokens",
            "Prompt tokens of first admissions not served from the prefix cache, by why (every cause is listed; "
            "they sum to queries - hits): in_flight, evicted, expired, isolated, unknown (an eviction older than the "
            "history), never_seen, granularity, routed (behind a router: another replica holds the page).",
            labels=["model_name", "cause"],
        )
        for cause in CAUSES:
            missed.add_metric([self.model_name, cause], float(stats.prefix_cache_missed_by_cause.get(cause, 0)))
        yield missed
        yield counter(
            "prefixkv:num_preemptions", "Requests preempted (recomputed later).", float(stats.num_preemptions)
        )
        yield counter("prefixkv:prompt_tokens", "Prompt tokens processed.", float(stats.prompt_tokens_total))
        yield counter("prefixkv:generation_tokens", "Tokens generated.", float(stats.generation_tokens_total))
        yield counter(
            "prefixkv:jump_forward_tokens",
            "Of the tokens generated, those a grammar forced, appended without sampling (--jump-forward).",
            float(stats.jump_forward_tokens_total),
        )
        if stats.kv_tier is not None:
            yield from self._kv_offload(stats, stats.kv_tier)
        if stats.kv_remote_status is not None:
            yield from self._kv_remote(stats)

    def _kv_remote(self, stats: EngineStats):
        """The shared store's series (only with kv_remote): whether it answers, and what became of each chunk
        this replica asked it for or gave it."""
        labels = [self.model_name]
        up = GaugeMetricFamily(
            "prefixkv:kv_remote_up",
            "1 while the shared KV store answers, 0 while the engine recomputes without it.",
            labels=["model_name"],
        )
        up.add_metric(labels, 1.0 if stats.kv_remote_status == "ok" else 0.0)
        yield up
        chunks = CounterMetricFamily(
            "prefixkv:kv_remote_chunks",
            "Chunks by outcome: hit and miss (reads), stored and already_stored (writes: another replica had it), "
            "refused (the store was full), foreign (another model's or build's value), corrupt (damaged, dropped), "
            "skipped_recompute_cheaper (not looked up: recomputing was measured faster than reading).",
            labels=["model_name", "outcome"],
        )
        for outcome, count in (
            ("hit", stats.kv_remote_hits),
            ("miss", stats.kv_remote_misses),
            ("stored", stats.kv_remote_stored),
            ("already_stored", stats.kv_remote_already_stored),
            ("refused", stats.kv_remote_refused),
            ("foreign", stats.kv_remote_foreign),
            ("corrupt", stats.kv_remote_corrupt),
            ("skipped_recompute_cheaper", stats.kv_remote_skipped_recompute_cheaper),
        ):
            chunks.add_metric([self.model_name, outcome], float(count))
        yield chunks
        for name, doc, value in (
            ("unreachable", "Store calls that failed on the connection or timed out.", stats.kv_remote_unreachable),
            ("outages", "Times the store went from answering to not answering.", stats.kv_remote_outages),
            ("read_bytes", "Bytes read from the store.", stats.kv_remote_bytes_read),
            ("written_bytes", "Bytes written to the store.", stats.kv_remote_bytes_written),
            ("read_seconds", "Seconds spent reading from the store.", stats.kv_remote_read_seconds),
        ):
            family = CounterMetricFamily(f"prefixkv:kv_remote_{name}", doc, labels=["model_name"])
            family.add_metric(labels, float(value))
            yield family

    def _kv_offload(self, stats: EngineStats, tier: str):
        """The KV offload tier's series (only with a tier configured): hit tokens per tier ("pool", and the
        tier's own name, "host" or "disk"), and the tier's traffic, fill and damage."""
        labels, values = ["model_name", "tier"], [self.model_name, tier]
        hits = CounterMetricFamily(
            "prefixkv:kv_offload_hit_tokens",
            "Tokens admitted as cached, by where their KV was: the pool, or the tier (loaded instead of recomputed).",
            labels=labels,
        )
        hits.add_metric([self.model_name, "pool"], float(stats.kv_pool_hit_tokens))
        hits.add_metric(values, float(stats.kv_tier_hit_tokens))
        yield hits
        for kind, name, doc, value in (
            (CounterMetricFamily, "loaded_bytes", "KV bytes loaded into the pool.", stats.kv_tier_loaded_bytes),
            (
                CounterMetricFamily,
                "load_seconds",
                "Seconds spent reading and verifying tier entries and writing them into the pool.",
                stats.kv_tier_load_seconds,
            ),
            (CounterMetricFamily, "saved_chunks", "Chunks stored into the tier.", stats.kv_tier_saved_chunks),
            (
                CounterMetricFamily,
                "dropped_saves",
                "Chunks not stored because the tier's writer was behind (recomputed if needed again).",
                stats.kv_tier_dropped_saves,
            ),
            (
                CounterMetricFamily,
                "corrupt",
                "Tier entries found damaged and dropped (recomputed, never served).",
                stats.kv_tier_corrupt,
            ),
            (
                CounterMetricFamily,
                "read_ahead_chunks",
                "Chunks read back before an agent session's next turn arrived (session policy +prefetch).",
                stats.kv_tier_read_ahead_chunks,
            ),
            (
                CounterMetricFamily,
                "read_ahead_loaded_chunks",
                "Of the chunks read ahead, those the session's next turn loaded into the pool.",
                stats.kv_tier_read_ahead_loaded_chunks,
            ),
            (GaugeMetricFamily, "entries", "Chunks held by the tier.", stats.kv_tier_entries),
            (GaugeMetricFamily, "bytes", "KV payload bytes held by the tier.", stats.kv_tier_bytes),
            (GaugeMetricFamily, "capacity_bytes", "The tier's capacity in bytes.", stats.kv_tier_capacity_bytes),
        ):
            family = kind(f"prefixkv:kv_offload_{name}", doc, labels=labels)
            family.add_metric(values, float(value))
            yield family


class ServerMetrics:
    def __init__(self, model_name: str, kernels: dict[str, str] | None = None) -> None:
        """kernels: the engine's hardware and kernel labels (ModelRunner.kernel_report), exported as the info
        series prefixkv:kernel_info (value 1), as vLLM exports its cache config."""
        disable_created_metrics()  # no `_created` twin per series (process-wide, as vLLM does)
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        self.ttft = Histogram(
            "prefixkv:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.tpot = Histogram(
            "prefixkv:time_per_output_token_seconds",
            "Mean time between output tokens.",
            labels,
            buckets=_TPOT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.e2e = Histogram(
            "prefixkv:e2e_request_latency_seconds",
            "Arrival to last token.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.request_success = Counter(
            "prefixkv:request_success",
            "Finished sequences by finish reason.",
            labels + ["finished_reason"],
            registry=self.registry,
        )
        self.prompt_cache_keyed = Counter(
            "prefixkv:prompt_cache_key_requests",
            "Requests that carried a prompt_cache_key (the keys themselves are not labels).",
            labels,
            registry=self.registry,
        ).labels(model_name)
        if kernels:
            names = sorted(kernels)
            Gauge(
                "prefixkv:kernel_info",
                "The device, CPU model, ISA path (amx, avx512_bf16, avx2 or torch), matmul and attention kernels and "
                "whether bf16 cache invariance is on; always 1.",
                ["model_name", *names],
                registry=self.registry,
            ).labels(model_name, *(kernels[k] for k in names)).set(1)
        self._stats = _EngineStatsCollector(model_name)
        self.registry.register(self._stats)

    def observe_finished(self, finished: FinishedRequest) -> None:
        """Called once per finished engine request (all n completions of it)."""
        for reason in finished.finish_reasons:
            self.request_success.labels(self.model_name, reason or "unknown").inc()
        m = finished.metrics
        if m is None:
            return
        if m.first_token_time is not None:
            self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
        if m.finish_time is not None:
            self.e2e.observe(max(0.0, m.finish_time - m.arrival_time))
            num_tokens = finished.num_generated_tokens
            if m.first_token_time is not None and num_tokens > 1:
                self.tpot.observe(max(0.0, (m.finish_time - m.first_token_time) / (num_tokens - 1)))

    def observe_aborted(self, count: int) -> None:
        """Requests aborted before finishing (client gone); the engine reports no output for them."""
        self.request_success.labels(self.model_name, "abort").inc(count)

    def render(self, engine_stats: EngineStats) -> bytes:
        self._stats.stats = engine_stats
        return generate_latest(self.registry)
