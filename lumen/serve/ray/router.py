"""Which replica serves a request: Ray Serve's public request-router API (ray.serve.request_router), with the
engine's own block names, so "cached" means what the replica's BlockManager means.

Prefix-aware (policy "prefix"): name the prompt's leading full blocks as the engine names them
(block_manager.block_digest, chained), and send the request to the replica whose prefix cache holds the longest
run of them, unless that replica has more than `imbalance` requests in flight beyond the least loaded one
(overloaded): then to the least loaded. No match: the least loaded. A replica's cache is known from two sources:
what it reports every routing-stats period (its named blocks, so evictions are seen) and what this router sent
it (a prefix routed a moment ago counts while its request runs, and until a report taken after it completed). Ties on the match go to the
least loaded; ties on the load to the replica that was sent fewer requests so far.

Calls of the methods in DIRECT (a prefill replica's export_kv and release_kv, lumen.serve.ray.pd) go to the replica
their first argument names, and count nowhere.

Policy "pow2" is Ray Serve's default procedure (power of two choices: two random replicas, the one with the
shorter queue), kept here as the baseline so /metrics reads the same either way.

Ray builds the router itself, in the process that holds the handle (the ingress), from a copy of this module
(Ray pickles a router's module by value), and gives it only request_router_kwargs; the router puts itself in
lumen.serve.ray.metrics.ROUTERS (the one process-wide table, keyed by deployment), where /metrics finds it.
"""
from __future__ import annotations

import random
import threading
import time
from collections import Counter

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ...engine.block_manager import block_digest
from ...kernels.attention import BLOCK
from .replica import NAME_BYTES

INF = float("inf")
CHOSEN_TTL_S = 30.0                            # a request chosen for a replica but never routed: forgotten
DIRECT = ("export_kv", "release_kv")           # methods served by the replica their first argument names


def block_names(tokens: list[int], limit: int | None = None) -> list[bytes]:
    """The names the engine gives the prompt's full blocks (the last token is never cached: it must be
    computed to sample), shortened as replicas report them."""
    n = (len(tokens) - 1) // BLOCK
    if limit is not None:
        n = min(n, limit)
    out, parent = [], b""
    for i in range(n):
        parent = block_digest(parent, tokens[i * BLOCK:(i + 1) * BLOCK])
        out.append(parent[:NAME_BYTES])
    return out


class PrefixIndex:
    """Per replica: the block names in its last report (and when it took it), and the names of the requests
    routed to it: those count while in flight and until a report taken after they completed says otherwise."""

    def __init__(self):
        self.reported: dict[str, tuple[set[bytes], float]] = {}
        self.routed: dict[str, dict[bytes, float]] = {}           # name -> completed at (inf: in flight)

    def report(self, replica: str, names, taken_at: float) -> None:
        if replica not in self.reported or self.reported[replica][1] < taken_at:
            self.reported[replica] = (set(names), taken_at)
            d = self.routed.get(replica, {})
            for n in [n for n, t in d.items() if t < taken_at]:
                del d[n]                                            # the report knows better now

    def add(self, replica: str, names: list[bytes]) -> None:
        d = self.routed.setdefault(replica, {})
        for n in names:
            d[n] = INF

    def completed(self, replica: str, names: list[bytes], now: float) -> None:
        d = self.routed.get(replica, {})
        for n in names:
            if n in d:
                d[n] = now

    def drop(self, replica: str) -> None:
        self.reported.pop(replica, None)
        self.routed.pop(replica, None)

    def match(self, replica: str, names: list[bytes]) -> int:
        """Leading blocks of `names` the replica holds."""
        rep, routed = self.reported.get(replica, (set(), 0.0))[0], self.routed.get(replica, {})
        k = 0
        for n in names:
            if n not in rep and n not in routed:
                break
            k += 1
        return k


def choose(matches: dict, loads: dict, routed: dict, imbalance: int) -> tuple[list, str]:
    """(replicas in order of preference, the decision) from each replica's matched blocks, requests in flight
    and requests routed so far (ties on the load go to the replica that had fewer: distinct prompts alternate)."""
    least = min(loads.values())
    by_load = sorted(loads, key=lambda r: (loads[r], routed[r]))
    best = max(matches, key=lambda r: (matches[r], -loads[r], -routed[r]))
    if matches[best] == 0:
        return by_load, "least_loaded"
    if loads[best] - least > imbalance:
        return by_load, "overloaded"
    return [best] + [r for r in by_load if r != best], "prefix"


class LumenRouter(RequestRouter):
    def initialize_state(self, policy: str = "prefix", imbalance: int = 8, max_blocks: int = 256):
        if policy not in ("prefix", "pow2"):
            raise ValueError(f"policy must be 'prefix' or 'pow2', got {policy!r}")
        self.policy, self.imbalance, self.max_blocks = policy, imbalance, max_blocks
        self.index = PrefixIndex()
        self.inflight: Counter = Counter()            # replica id -> requests routed there, not completed
        self.routed: Counter = Counter()              # replica id -> requests routed there
        self.decisions: Counter = Counter()           # decision -> requests
        self.matched_blocks = 0                       # blocks the chosen replica was expected to hold
        self.lock = threading.Lock()
        self._names: dict[str, list[bytes]] = {}      # internal request id -> its prompt's block names
        self._chosen: dict[str, tuple] = {}           # internal request id -> (preferred replica, decision,
        #                                               blocks expected cached there, when chosen)
        self._running: dict[str, str] = {}            # internal request id -> the replica it counts in flight on
        self._direct: dict[str, float] = {}           # internal id -> when: calls to a named replica (DIRECT)
        self._done_first: dict[tuple, tuple] = {}     # (request id, replica) -> (when, its _chosen entry):
        #                                               completed before it was reported routed
        import lumen.serve.ray.metrics                # imported, not copied with this module: shared
        lumen.serve.ray.metrics.ROUTERS[self._deployment_id.name] = self

    # ---- what the ingress reads
    def replica_stats(self) -> dict[str, dict]:
        """Each running replica's last routing stats (the replica's unique id -> its record_routing_stats)."""
        return {rid.unique_id: dict(r.routing_stats) for rid, r in list(self.curr_replicas.items())
                if r.routing_stats}

    # ---- Ray's hooks
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True     # all replicas were candidates: back off
        if not candidate_replicas:
            return []
        if pending_request is not None and pending_request.metadata.call_method in DIRECT:
            with self.lock:                           # to the replica named by its first argument (pd.py)
                now = time.time()
                self._direct[pending_request.metadata.internal_request_id] = now
                for key in [k for k, t in self._direct.items() if now - t > CHOSEN_TTL_S]:
                    del self._direct[key]             # never routed (the replica is gone): forgotten
            target = pending_request.args[0]
            return [[r] for r in candidate_replicas if r.replica_id.unique_id == target]
        if self.policy == "pow2" or pending_request is None:
            two = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
            if pending_request is not None:
                with self.lock:
                    self._chosen[pending_request.metadata.internal_request_id] = (None, "pow2", 0, time.time())
            return [two]
        names = self._request_names(pending_request)
        now = time.time()                             # the replicas' reports say when they were taken, in wall time
        with self.lock:
            for r in candidate_replicas:
                st = r.routing_stats
                if st and "blocks" in st:
                    self.index.report(r.replica_id.unique_id, st["blocks"], st["taken_at"])
            matches = {r: self.index.match(r.replica_id.unique_id, names) for r in candidate_replicas}
            self._chosen.pop(pending_request.metadata.internal_request_id, None)    # a retry: chosen again
            for key in [k for k, v in self._chosen.items() if now - v[3] > CHOSEN_TTL_S]:
                del self._chosen[key]                 # chosen, then cancelled before it was routed
            choosing = Counter(v[0] for v in self._chosen.values())               # chosen, not yet routed
            loads = {r: self.inflight[r.replica_id.unique_id] + choosing[r.replica_id.unique_id]
                     for r in candidate_replicas}
            routed = {r: self.routed[r.replica_id.unique_id] for r in candidate_replicas}
            order, decision = choose(matches, loads, routed, self.imbalance)
            first = order[0].replica_id.unique_id
            self._chosen[pending_request.metadata.internal_request_id] = (first, decision, matches[order[0]], now)
            self.index.add(first, names)              # requests chosen at the same moment follow this one
        return [[r] for r in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        rid = replica_id.unique_id
        key = pending_request.metadata.internal_request_id
        if key in self._direct:
            return
        names = self._request_names(pending_request)
        with self.lock:
            done = self._done_first.pop((key, rid), None)
            chosen = self._chosen.pop(key, None) or (done[1] if done else None)
            first, decision, matched, _ = chosen or (None, "unrouted", 0, 0.0)
            if first is not None and first != rid:  # the preferred replica was full: Ray took the next
                decision, matched = "overloaded", 0
            self.routed[rid] += 1
            self.index.add(rid, names)
            self.decisions[decision] += 1
            self.matched_blocks += matched
            if done is None:
                self.inflight[rid] += 1
                self._running[key] = rid
            else:                                   # it has completed already: in flight no more
                self.index.completed(rid, names, time.time())
                self._names.pop(key, None)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Ray registers the completion callback before it reports the request routed (it awaits the replica's
        accept in between), so a short request can complete first: it is then remembered, and its routed report
        does not count it in flight (before, the count stayed at 1 for good: seen in a full test run). A replica's
        rejection completes an attempt that is never routed there: remembered as long as a chosen request is."""
        with self.lock:
            rid, key, now = replica_id.unique_id, internal_request_id, time.time()
            if key in self._direct:
                del self._direct[key]
                return
            if self._running.get(key) == rid:
                del self._running[key]
                self.inflight[rid] -= 1                 # counted by on_request_routed (_running says so)
                self.index.completed(rid, self._names.pop(key, []), now)
                self._chosen.pop(key, None)
                return
            self._done_first[(key, rid)] = (now, self._chosen.pop(key, None))   # for the routed report, if any
            self._names.pop(key, None)              # (recomputed if a retry or that report asks)
            for k in [k for k, v in self._done_first.items() if now - v[0] > CHOSEN_TTL_S]:
                del self._done_first[k]

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        with self.lock:
            rid = replica_id.unique_id
            self.index.drop(rid)
            self.inflight.pop(rid, None)
            for key in [k for k, r in self._running.items() if r == rid]:
                del self._running[key]

    # ----
    def _request_names(self, pr: PendingRequest) -> list[bytes]:
        """The block names of the request's first prompt (generate(prompts, params): args[0][0]), once."""
        key = pr.metadata.internal_request_id
        names = self._names.get(key)
        if names is None:
            try:
                tokens = pr.args[0][0]
            except (IndexError, TypeError, KeyError):
                tokens = []
            names = self._names[key] = block_names(tokens, self.max_blocks) if self.policy == "prefix" else []
        return names
