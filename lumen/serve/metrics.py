"""GET /metrics: Prometheus metrics named as vLLM names them, with the `lumen:` prefix.

Read from the engine when scraped:
    lumen:num_requests_running, lumen:num_requests_waiting       gauges
    lumen:kv_cache_usage_perc                                    gauge, 0..1 (blocks held by requests)
    lumen:kv_cache_free_blocks, lumen:kv_cache_total_blocks      gauges
    lumen:prefix_cache_queries_total, lumen:prefix_cache_hits_total   counters, prompt tokens
    lumen:prefix_cache_hit_rate                                  gauge, hits / queries since start
    lumen:num_preemptions_total                                  counter
    lumen:kv_held_blocks                                         gauge: held for a transfer (lumen.engine.kv_transfer)
    lumen:compute_threads, lumen:compute_threads_max             gauges: the step's threads now, and the most
    lumen:cpu_others_cores                                       gauge: what others used (lumen.engine.threads)
    lumen:compute_threads_changes_total                          counter
Observed as requests advance and finish:
    lumen:prompt_tokens_total          prompt tokens of requests that produced a first token
    lumen:generation_tokens_total      tokens generated
    lumen:time_to_first_token_seconds, lumen:inter_token_latency_seconds, lumen:e2e_request_latency_seconds,
    lumen:request_queue_time_seconds   histograms
    lumen:request_success_total{finished_reason=stop|length|abort|error}
And prometheus_client's process_* metrics (process_resident_memory_bytes: the soak benchmark's RSS); not its
`*_created` series (disable_created_metrics, below).
"""
from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, ProcessCollector,
                               disable_created_metrics, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine.sequence import RequestOutput

# No `*_created` series (the Unix time each counter and histogram was made, one more series for each): noise to a
# user, and what a scraper uses them for (spotting a reset) it does from the counters dropping. vLLM turns them off
# the same way; it is process-wide, and this module is imported by the server processes only.
disable_created_metrics()

# vLLM's buckets
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class _EngineState:
    """The engine's state at scrape time."""

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self):
        s = self.engine.stats()
        labels = ["model_name"]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(f"lumen:{name}", doc, labels=labels)
            g.add_metric([self.model_name], value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(f"lumen:{name}", doc, labels=labels)
            c.add_metric([self.model_name], value)
            return c

        yield gauge("num_requests_running", "Requests holding KV blocks (running).", s["running"])
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s["waiting"])
        yield gauge("kv_cache_usage_perc", "Share of the KV block pool held by requests (1 = full).", s["kv_usage"])
        yield gauge("kv_cache_free_blocks", "KV blocks not held by any request.", s["kv_free_blocks"])
        yield gauge("kv_cache_total_blocks", "KV blocks in the pool.", s["kv_blocks"])
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s["prefix_query_tokens"])
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", s["prefix_hit_tokens"])
        q = s["prefix_query_tokens"]
        yield gauge("prefix_cache_hit_rate", "Prefix cache hits / queries (prompt tokens) since start.",
                    s["prefix_hit_tokens"] / q if q else 0.0)
        yield gauge("kv_held_blocks", "KV blocks of finished prefills held for a decode engine to pull.",
                    s["kv_held_blocks"])
        yield counter("num_preemptions", "Preemptions (a request's blocks freed, recomputed later).",
                      s["preemptions"])
        g = self.engine.runner.governor
        yield gauge("compute_threads", "Threads the engine's steps run on now (lumen.engine.threads).", g.n)
        yield gauge("compute_threads_max", "The most threads a step may run on (--threads).", g.max)
        yield gauge("cpu_others_cores", "Cores' worth of CPU that other processes and the server's other threads "
                    "used at the governor's last reading.", g.others)
        yield counter("compute_threads_changes", "Times the thread governor changed the step's thread count.",
                      g.changes)


class Metrics:
    def __init__(self, engine, model_name: str):
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        self.ttft = Histogram("lumen:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("lumen:inter_token_latency_seconds", "Time between consecutive tokens.", labels,
                             buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("lumen:e2e_request_latency_seconds", "Arrival to finish.", labels,
                             buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.queue = Histogram("lumen:request_queue_time_seconds", "Arrival to first scheduled.", labels,
                               buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter("lumen:prompt_tokens", "Prompt tokens processed.", labels,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("lumen:generation_tokens", "Tokens generated.", labels,
                                         registry=r).labels(model_name)
        self.finished = Counter("lumen:request_success", "Finished requests by finish reason.",
                                labels + ["finished_reason"], registry=r)
        self.spec_drafts = Counter("lumen:spec_decode_num_draft_tokens", "Speculative tokens drafted and verified.",
                                   labels, registry=r).labels(model_name)
        self.spec_accepted = Counter("lumen:spec_decode_num_accepted_tokens", "Speculative tokens accepted.",
                                     labels, registry=r).labels(model_name)
        self.spec_steps = Counter("lumen:spec_decode_num_verify_steps", "Steps that verified drafted tokens "
                                  "(mean accepted length = (accepted + verify steps) / verify steps).", labels,
                                  registry=r).labels(model_name)
        r.register(_EngineState(engine, model_name))
        ProcessCollector(registry=r)         # process_resident_memory_bytes and friends (Linux), for soak runs
        self._started: set[str] = set()      # requests whose prompt tokens are counted

    def observe(self, out: RequestOutput) -> None:
        """Count one engine output (called for every output, in step order)."""
        m = out.metrics
        if out.delta_token_ids:
            self.generation_tokens.inc(len(out.delta_token_ids))
            if out.request_id not in self._started:
                self._started.add(out.request_id)
                self.prompt_tokens.inc(m.prompt_tokens)
        if not out.finished:
            return
        self._started.discard(out.request_id)
        self.finished.labels(self.model_name, out.finish_reason or "error").inc()
        if m.spec_steps:
            self.spec_drafts.inc(m.spec_proposed)
            self.spec_accepted.inc(m.spec_accepted)
            self.spec_steps.inc(m.spec_steps)
        if m.ttft_s is not None:
            self.ttft.observe(m.ttft_s)
            self.queue.observe(m.queue_s)
        for gap in m.itl:
            self.itl.observe(gap)
        if m.e2e_s is not None:
            self.e2e.observe(m.e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
