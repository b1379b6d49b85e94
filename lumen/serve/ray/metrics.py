"""/metrics of the Ray application: every replica's series (lumen.serve.metrics, as each replica rendered it for
its last routing stats, at most request_routing_stats_period_s old) with a `replica` label, and the router's:

    lumen:router_decisions_total{decision=prefix|overloaded|least_loaded|pow2}   requests routed, by why
    lumen:router_matched_blocks_total        prompt blocks the chosen replica was expected to hold (prefix)
    lumen:router_requests_in_flight{replica} requests routed to the replica and not completed
    lumen:replica_info{replica, pid}         1 per running replica

The replicas of a deployment in ALSO (the prefill pool beside the decode pool) carry a `pool` label too
(pool="prefill"): their requests are the decode pool's again, so a sum over every replica would count them twice.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

ROUTERS: dict = {}                 # deployment name -> its LumenRouter in this process (set by the router)
ALSO: dict = {}                    # deployment name -> {more deployments whose replicas' series it shows: their
                                   # pool label} (pd.py)


class ReplicaMetrics:
    """The app's `metrics` (render() -> bytes) over the router of the engine deployment."""

    def __init__(self, deployment: str):
        self.deployment = deployment
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def router(self):
        return ROUTERS.get(self.deployment)

    def running(self) -> dict[str, int]:
        """deployment -> its replicas that Ray routes to now (one that died leaves at once, a new one comes when
        it is up), for the engine deployment and those in ALSO whose router exists."""
        out = {}
        for name in (self.deployment, *ALSO.get(self.deployment, ())):
            router = ROUTERS.get(name)
            if router is not None:
                out[name] = len(router.curr_replicas)
        return out

    def collect(self):
        router = self.router()
        if router is None:                          # no request routed yet
            return
        stats = router.replica_stats()
        pools: dict[str, str] = {}
        for other, pool in ALSO.get(self.deployment, {}).items():   # the prefill pool's replicas, beside the
            if ROUTERS.get(other) is not None:                       # decode pool's
                theirs = ROUTERS[other].replica_stats()
                stats.update(theirs)
                pools.update(dict.fromkeys(theirs, pool))
        families: dict[str, Metric] = {}
        for replica, st in sorted(stats.items()):
            text = st.get("metrics")
            if not text:
                continue
            labels = {"replica": replica, **({"pool": pools[replica]} if replica in pools else {})}
            for fam in text_string_to_metric_families(text.decode() if isinstance(text, bytes) else text):
                merged = families.get(fam.name)
                if merged is None:
                    merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                merged.samples += [Sample(s.name, {**s.labels, **labels}, s.value, s.timestamp, s.exemplar)
                                   for s in fam.samples]
        yield from families.values()
        info = GaugeMetricFamily("lumen:replica_info", "Running replicas (1 each), with their process id.",
                                 labels=["replica", "pid"])
        for replica, st in sorted(stats.items()):
            info.add_metric([replica, str(st.get("pid", ""))], 1)
        yield info
        with router.lock:
            decisions, matched = dict(router.decisions), router.matched_blocks
            inflight = dict(router.inflight)
        d = CounterMetricFamily("lumen:router_decisions", "Requests routed, by the router's decision.",
                                labels=["policy", "decision"])
        for decision, n in sorted(decisions.items()):
            d.add_metric([router.policy, decision], n)
        yield d
        yield CounterMetricFamily("lumen:router_matched_blocks", "Prompt blocks the chosen replica was expected "
                                  "to hold in its prefix cache.", value=matched)
        g = GaugeMetricFamily("lumen:router_requests_in_flight", "Requests routed to a replica, not completed.",
                              labels=["replica"])
        for replica, n in sorted(inflight.items()):
            g.add_metric([replica], n)
        yield g

    def render(self) -> bytes:
        return generate_latest(self.registry)
