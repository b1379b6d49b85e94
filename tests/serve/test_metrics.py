"""/metrics' text: prometheus_client's *_created series are off (one more series per counter and histogram,
noise to a user; vLLM disables them too), the counters and histograms themselves are all there."""
from types import SimpleNamespace

from lumen.engine.sequence import RequestMetrics, RequestOutput
from lumen.serve.metrics import Metrics

STATS = {"running": 0, "waiting": 0, "kv_usage": 0.0, "kv_free_blocks": 8, "kv_blocks": 8,
         "prefix_query_tokens": 0, "prefix_hit_tokens": 0, "kv_held_blocks": 0, "preemptions": 0}


def test_no_created_series():
    engine = SimpleNamespace(stats=lambda: STATS,
                             runner=SimpleNamespace(governor=SimpleNamespace(n=2, max=2, others=0.0, changes=0)))
    m = Metrics(engine, "tiny")
    metrics = RequestMetrics(arrival=1.0, first_scheduled=1.01, first_token=1.1, finished=1.3, prompt_tokens=3)
    m.observe(RequestOutput("r", [1, 2, 3], [7], "x", True, "stop", metrics, delta_token_ids=[7]))
    text = m.render().decode()
    assert "_created" not in text, [ln for ln in text.splitlines() if "_created" in ln][:3]
    for series in ("lumen:generation_tokens_total{", "lumen:request_success_total{",
                   "lumen:time_to_first_token_seconds_count{", "lumen:e2e_request_latency_seconds_bucket{",
                   "lumen:num_requests_running{"):
        assert series in text, series
