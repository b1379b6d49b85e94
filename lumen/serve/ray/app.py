"""The Ray Serve application: an ingress deployment serving lumen.serve.app's FastAPI app (the same routes,
parameters, errors, SSE and X-Request-Id as one process) over an engine deployment of N replicas, and the
process that starts it, serves until SIGTERM/SIGINT, and stops it.

    build(...)      the Application: Ingress.bind(EngineReplica deployment.bind(...))
    serve_on_ray()  connect (a local instance of our own, lumen.serve.ray.local, or --ray-address's cluster),
                    serve.run on --host:--port, wait for a signal, then stop: on a joined cluster delete the
                    application and nothing else; our local instance is stopped with every process of it
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

import psutil
from fastapi.responses import JSONResponse
from ray import serve
from ray.serve.config import RequestRouterConfig

from ...cpu import usable_cpus
from ...engine.config import EngineConfig
from ..app import Settings, build_app
from ..openai.health import ServingHealth
from .local import LocalRay, _signal, sigterm_kept
from .metrics import ReplicaMetrics
from .remote import ModelInfo, RemoteWorker
from .replica import EngineReplica
from .router import LumenRouter

log = logging.getLogger("lumen.serve")
APP, INGRESS, ENGINE = "lumen", "LumenIngress", "LumenEngine"
CONNECT_TIMEOUT_S = 5.0                 # --ray-address host:port must accept a connection within this
ROUTING_STATS_PERIOD_S = 1.0            # how often each replica reports its cached blocks, load and metrics
MAX_CONSTRUCTOR_RETRIES = 2             # a replica that cannot load its engine: the start fails, not retried 20x
STOP_DEADLINE_S = 10.0                  # a signal while starting: every process we started is killed past this


@serve.ingress()
class Ingress:
    """Tokenizes and validates (lumen.serve.app over a RemoteWorker); the replicas run the engines."""

    async def __init__(self, engine, model: str, settings: Settings, chat_template: str | None):
        from ...format.chat import chat_template_from_metadata
        from ..prompts import Prompter
        info = await engine.info.remote()                     # the replicas' limits (one answers for all)
        model_info = await asyncio.to_thread(ModelInfo, model, info["max_model_len"])
        template = chat_template if chat_template is not None else \
            chat_template_from_metadata(model_info.parts.gguf.metadata)
        self.prompter = Prompter(model_info.tokenizer, template, model_info.max_model_len)
        self.worker = RemoteWorker(engine, model_info)
        self.metrics = ReplicaMetrics(ENGINE)
        self.settings = settings
        self.pools: dict[str, bool] = {ENGINE: True}          # deployment -> whether /health needs one running

    def __serve_build_asgi_app__(self):
        app = build_app(self.worker, self.prompter, self.metrics, self.settings)
        app.state.health = ReplicaHealth(self.worker, self.metrics, self.pools)
        app.add_middleware(ProxyRequestId)
        return app


class ReplicaHealth(ServingHealth):
    """/health of the application: the single process's answer with the replicas Ray routes to now, per
    deployment ({"status": "ok", "replicas": {"LumenEngine": 2}}), and 503 while a deployment the application
    needs has none (every replica died, and none has been restarted yet): a load balancer then sends elsewhere.
    pools: deployment -> needed. With prefill and decode apart, the prefill pool is needed when a failed hand-off
    answers 503 (--kv-failure error); with recompute the decode replicas prefill meanwhile, and the answer is 200
    with "status": "degraded" and the pool that has none."""

    def __init__(self, worker, metrics, pools: dict[str, bool]):
        super().__init__(worker, metrics)
        self.pools = pools

    def health(self):
        answer = super().health()
        if not isinstance(answer, dict):                  # shutting down
            return answer
        running = self.metrics.running()
        empty = [name for name in self.pools if running.get(name, 1) == 0]
        if any(self.pools[name] for name in empty):
            return JSONResponse({"status": "no replica running", "replicas": running}, status_code=503)
        if empty:
            return {"status": "degraded", "replicas": running, "none_running": empty}
        return {**answer, "replicas": running}


class ProxyRequestId:
    """Ray's proxy puts X-Request-Id on every response (the client's, or the one it made and handed to the Gate):
    the Gate's copy is dropped so the header is there once, as from one process."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        async def send_(msg):
            if msg["type"] == "http.response.start":
                msg = dict(msg, headers=[(k, v) for k, v in msg.get("headers", []) if k.lower() != b"x-request-id"])
            await send(msg)
        return await self.app(scope, receive, send_ if scope["type"] == "http" else send)


@dataclass(frozen=True)
class Scale:
    """How the engine deployment scales: replicas (the initial count), Ray Serve's autoscaling bounds
    (min_replicas / max_replicas; None: a fixed count), and the router: "prefix" (lumen.serve.ray.router, with
    imbalance: the in-flight gap past which it leaves the replica holding the prefix) or "pow2" (Ray's power of two
    choices)."""
    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    router: str = "prefix"
    imbalance: int | None = None

    @property
    def bounds(self) -> tuple[int, int] | None:
        """(min, max) of Ray Serve's autoscaling, or None for a fixed count."""
        if self.min_replicas is None and self.max_replicas is None:
            return None
        lo = self.min_replicas if self.min_replicas is not None else 1
        return lo, self.max_replicas if self.max_replicas is not None else max(lo, self.replicas)

    @property
    def initial(self) -> int:
        """The replicas started first (the CPUs the start needs: see cpus_short)."""
        return self.replicas if self.bounds is None else min(max(self.replicas, self.bounds[0]), self.bounds[1])


def build(model: str, config: EngineConfig, settings: Settings, *, scale: Scale = Scale(), max_queue: int = 256,
          chat_template: str | None = None, shutdown_timeout: float = 30.0, health_check_period_s: float = 2.0):
    """The application: the ingress over an engine deployment whose replicas each run Engine(model, config)
    (config.threads threads, asking Ray for as many CPUs) behind the same app and settings as one process."""
    max_num_seqs, threads = config.max_num_seqs, config.threads or 1
    scaling: dict = {"num_replicas": scale.replicas}
    if scale.bounds is not None:
        lo, hi = scale.bounds
        scaling = {"autoscaling_config": {"min_replicas": lo, "max_replicas": hi, "initial_replicas": scale.initial,
                                          "target_ongoing_requests": max_num_seqs}}
    engine = serve.deployment(
        EngineReplica, name=ENGINE, ray_actor_options={"num_cpus": threads},
        max_ongoing_requests=max_num_seqs + max_queue + 1,  # a full replica answers 429 itself, as one process
        request_router_config=RequestRouterConfig(
            request_router_class=LumenRouter, request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            request_router_kwargs={"policy": scale.router,
                                   "imbalance": max_num_seqs // 2 if scale.imbalance is None else scale.imbalance}),
        health_check_period_s=health_check_period_s, graceful_shutdown_timeout_s=shutdown_timeout,
        max_constructor_retry_count=MAX_CONSTRUCTOR_RETRIES, **scaling)
    ingress = serve.deployment(Ingress, name=INGRESS, num_replicas=1, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=4096, graceful_shutdown_timeout_s=shutdown_timeout,
                               max_constructor_retry_count=MAX_CONSTRUCTOR_RETRIES)
    return ingress.bind(engine.bind(model, settings.model_id, config, max_queue), model, settings, chat_template)


def connect(address: str | None = None, *, num_cpus: int | None = None,
            log_to_driver: bool = True) -> LocalRay | None:
    """Join the cluster at `address`, or (None) start a local Ray instance of our own (returned, to be stopped)."""
    import ray
    if address:
        check_answers(address)
        with sigterm_kept():
            ray.init(address=address, log_to_driver=log_to_driver)
        return None
    return LocalRay(num_cpus=num_cpus, log_to_driver=log_to_driver)


def check_answers(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """ConnectionError unless a host:port address accepts a TCP connection within `timeout` (ray.init retries
    an address that does not answer for minutes). Other forms ('auto', ray://...) are left to Ray."""
    host, sep, port = address.rpartition(":")
    if not sep or "/" in address or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        raise ConnectionError(f"nothing answers at --ray-address {address}: {e}") from None


def cpus_short(replicas: int, threads: int, *, joined: bool, have: int | None = None,
               most: int | None = None) -> str | None:
    """Why the connected cluster (or `have` CPUs) cannot place every replica (each asks Ray for `threads` CPUs) nor,
    autoscaling, `most` of them (--max-replicas), or None when it can: Ray would keep the missing ones pending, and
    the start (or the scale-up) would wait for them for ever."""
    import ray
    have = int(ray.cluster_resources().get("CPU", 0)) if have is None else have
    where = "the Ray cluster has" if joined else "this machine has"
    if replicas * threads > have:
        return (f"{replicas} replica(s) x {threads} thread(s) ask Ray for {replicas * threads} CPUs, and {where} "
                f"{have}: use fewer replicas or --threads ({have // threads} replica(s) of {threads} thread(s) fit)")
    if most is not None and most * threads > have:
        return (f"--max-replicas {most} x {threads} thread(s) ask Ray for {most * threads} CPUs, and {where} "
                f"{have}: use --max-replicas {have // threads}" + (" or fewer --threads" if threads > 1 else ""))
    return None


class Taken(Exception):
    """The joined cluster cannot take our application as asked: its Serve listens elsewhere than --host:--port, or
    an application of our name runs there (another server's: not ours to replace, nor to delete)."""


def start(app, *, host: str, port: int) -> float:
    """Start Serve on the connected cluster and run the application on host:port; returns the seconds it took
    until the application answered. Taken when Serve already runs there on another address (serve.start keeps
    its first HTTP options: the application would answer there, not on host:port) or already runs an application
    named APP (serve.run would replace it)."""
    t0 = time.perf_counter()
    serve.start(http_options={"host": host, "port": port})
    where = _serve_address()
    if where is not None and where != (host, port):
        raise Taken(f"Ray Serve already runs on this cluster on {where[0]}:{where[1]} (its proxies keep the "
                    f"address they were started with): give --host {where[0]} --port {where[1]}")
    if APP in serve.status().applications:
        raise Taken(f"an application named {APP!r} already runs on this cluster (another Lumen server's?): "
                    "stop it first")
    serve.run(app, name=APP, route_prefix="/", blocking=False)
    return time.perf_counter() - t0


def _serve_address() -> tuple[str, int] | None:
    """(host, port) Serve's proxies listen on, or None where Ray does not say (read through its private client)."""
    try:
        from ray.serve.context import _get_global_client
        http = _get_global_client().http_config
        return http.host, int(http.port)
    except Exception:                             # noqa: BLE001 - another Ray version: not checked
        return None


def stop(local: LocalRay | None, grace: float = 2.0) -> None:
    """Delete our application (requests in flight get the deployments' graceful shutdown). On a cluster we
    joined: nothing else. On our local instance: then stop Serve and Ray, and any process of the instance that
    outlived them (no process is left), also when the delete failed. A second Ctrl-C (KeyboardInterrupt) is not
    caught here: the caller then stops everything at once (_stop_now)."""
    import ray
    try:
        serve.delete(APP, _blocking=False)
        _wait_deleted()
    except Exception as e:                    # noqa: BLE001 - whatever failed, the instance is stopped below
        log.warning("the application was not deleted: %s: %s", type(e).__name__, e)
    if local is not None:
        local.stop(grace)
    else:
        ray.shutdown()


def _wait_deleted(timeout: float = 300.0, poll: float = 0.2) -> None:
    """Wait until Serve no longer lists our application, in short sleeps: a second Ctrl-C (KeyboardInterrupt
    from serve_on_ray's handler) lands within one poll, where a blocking serve.delete held it for seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and APP in serve.status().applications:
        time.sleep(poll)


def serve_on_ray(app, *, host: str, port: int, address: str | None, replicas: int, threads: int,
                 max_replicas: int | None = None, signals: tuple = (signal.SIGINT, signal.SIGTERM)) -> int:
    """Run the application until one of `signals` (the command line's: SIGINT, SIGTERM and SIGHUP, whose default
    action ended this process alone and left the local instance's processes running, in their sessions of their
    own) comes (the command line's Ray path). The first signal stops it as
    stop() does (requests in flight get the shutdown timeout); a second one, or one while it starts, ends the
    local instance's processes at once (on a joined cluster: deletes the application without waiting). Should the
    local instance's core go (the signal reached its processes too, as systemd's stop of a unit signals every
    process of it; a signal to the process group does not: lumen.serve.ray.local.own_sessions), the process ends at
    once with every process of the instance (_Watchdog)."""
    done, state = threading.Event(), {"serving": False, "signals": 0, "deadline": False}
    me = os.getpid()

    def on_signal(sig, frame):
        if os.getpid() != me:        # a child of ray.init's between fork and exec runs the handler of a signal
            return                   # this process had: not its to stop (it printed a traceback from an at-fork hook)
        state["signals"] += 1
        if state["serving"] and state["signals"] == 1:
            done.set()
            return
        if not state["serving"] and not state["deadline"]:
            state["deadline"] = True
            _deadline()
        raise KeyboardInterrupt

    def catch_signals() -> dict:                   # again once Ray is up, should Ray have taken SIGTERM over
        return {sig: signal.signal(sig, on_signal) for sig in signals}

    short = None if address else cpus_short(replicas, threads, joined=False, have=usable_cpus(),
                                             most=max_replicas)
    if short:                      # surely short, said before Ray's seconds of start-up (Ray may count fewer CPUs
        print(f"error: {short}", file=sys.stderr)          # than the machine's, so it is checked again once up)
        return 1
    previous = catch_signals()
    unraisable = sys.unraisablehook

    def lost_interrupts(u):          # raised in an at-fork hook of ray.init's (Python ignores those, with a traceback):
        if not issubclass(u.exc_type, KeyboardInterrupt):      # said here by "stopped while starting" once it returns
            unraisable(u)

    sys.unraisablehook = lost_interrupts
    local = watchdog = None
    t0 = time.perf_counter()
    log.info("starting %d replica(s) x %d thread(s) on Ray (%s); Ctrl-C stops", replicas, threads,
             address or "a local instance of our own")
    try:
        try:
            local = connect(address)
            catch_signals()
            if state["signals"]:                      # its KeyboardInterrupt was swallowed (in an at-fork hook)
                raise KeyboardInterrupt
            if local is not None:
                watchdog = _Watchdog(local, lambda: state["signals"] > 0)
            short = cpus_short(replicas, threads, joined=address is not None, most=max_replicas)
            if short and local is not None:
                print(f"error: {short}", file=sys.stderr)
                _stop_now(local, address)
                return 1
            if short:
                log.warning("%s; Ray waits until the cluster has them", short)
            start(app, host=host, port=port)
            if state["signals"]:
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            return _stopped_while_starting(local, address)
        except Taken as e:                            # nothing of ours runs there: nothing to delete
            print(f"error: {e}", file=sys.stderr)
            _stop_now(local, address, delete=False)
            return 1
        except Exception as e:                        # noqa: BLE001 - Ray's and the replicas' failures: one line
            if state["signals"]:                      # the signal's KeyboardInterrupt, raised within Ray, came out
                return _stopped_while_starting(local, address)     # as another error (Ray's start gave up)
            print(f"error: the application did not start: {start_failure(e)}", file=sys.stderr)
            _stop_now(local, address)
            return 1
        log.info("serving on http://%s:%d: %d replica(s) x %d thread(s) on Ray (%s), ready in %.1f s", host, port,
                 replicas, threads, address or "a local instance", time.perf_counter() - t0)
        state["serving"] = True
        try:
            while not done.wait(0.5):
                pass
            if watchdog is not None:                  # did the signal reach Ray's processes too? Ask before Ray:
                time.sleep(0.1)                       # (the GCS closes its port within ~30 ms of a SIGTERM)
                gone = local.broken()
                if gone:
                    watchdog.end_now(gone)
            log.info("stopping; press Ctrl-C again to stop now")
            stop(local)
        except KeyboardInterrupt:
            log.info("stopping now")
            _stop_now(local, address)
    finally:
        if watchdog is not None:
            watchdog.close()
        for sig, h in previous.items():
            signal.signal(sig, h)
        sys.unraisablehook = unraisable
    log.info("stopped")
    return 0


def _stopped_while_starting(local: LocalRay | None, address: str | None) -> int:
    log.info("stopped while starting")
    _stop_now(local, address)
    if address is None:           # interrupted within ray.init, Ray's core is half made, and the interpreter's exit
        _end_children()           # crashed in it (SIGSEGV): out now, nothing of the instance left, nor the warm-up
        _flush_and_exit(0)        # child
    return 0


def _deadline(seconds: float = STOP_DEADLINE_S) -> None:
    """After a signal while starting: should this process still run `seconds` later, kill every process it started
    (Ray's, whose orphans come back to it: LocalRay makes it their subreaper) and exit 0. The KeyboardInterrupt that
    stops a start can be lost (Python ignores exceptions in at-fork hooks, and ray.init forks), and a start whose
    GCS got the signal too can wait a minute."""
    def end():
        log.warning("still starting %g s after the signal: killing every process this one started", seconds)
        procs = _signal(psutil.Process().children(recursive=True), "kill")
        psutil.wait_procs(procs, timeout=3.0)
        log.info("stopped while starting")
        _flush_and_exit(0)
    t = threading.Timer(seconds, end)
    t.daemon = True
    t.start()


def _end_children(grace: float = 3.0) -> None:
    """SIGTERM to every process this one started and is still there (after _stop_now: the warm-up child), SIGKILL
    after `grace` seconds."""
    _, alive = psutil.wait_procs(_signal(psutil.Process().children(recursive=True), "terminate"), timeout=grace)
    psutil.wait_procs(_signal(alive, "kill"), timeout=3.0)


def _flush_and_exit(code: int) -> None:
    for h in logging.getLogger().handlers + log.handlers:
        h.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _Watchdog:
    """Watches our local instance's core (LocalRay.broken, every `period` seconds) from a thread of its own. Once it
    has gone (systemd's stop signals every process of the unit, Ray's as well as this one), every Ray call waits
    ~60 s for the GCS, and the main thread may be inside one (a blocking GCS call, which no signal interrupts). So
    this thread ends the process itself: every process of the instance killed, then exit 0 after a signal, 1
    (with a one-line error) without one."""

    def __init__(self, local: LocalRay, signalled, period: float = 0.25):   # (a TCP connect to the GCS per look,
                                                                              # for the server's whole life)
        self.local, self.signalled, self.period = local, signalled, period
        self.end, self.lock = threading.Event(), threading.Lock()
        self.thread = threading.Thread(target=self._run, name="lumen-ray-watchdog", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.end.wait(self.period):
            gone = self.local.broken()
            if gone:
                self.end_now(gone)

    def end_now(self, gone: str) -> None:
        """Kill every process of the instance and exit. Quickly: once its raylet has gone, Ray's core exits this
        process (code 1) at its next call there."""
        with self.lock:                               # once, from whichever thread comes first
            self.local.kill(disconnect=False)         # (ray.shutdown would wait for the GCS too)
            signalled = self.signalled()
            if signalled:
                log.info("stopped at once: the signal reached the local Ray instance too (its %s had gone)", gone)
            else:
                print(f"error: the local Ray instance's {gone} ended; stopped", file=sys.stderr)
            _flush_and_exit(0 if signalled else 1)

    def close(self) -> None:
        self.end.set()
        self.thread.join()


def _stop_now(local: LocalRay | None, address: str | None, delete: bool = True) -> None:
    """Stop without waiting for anyone: kill our local instance's processes, or delete our application (not with
    delete=False: none of ours was made) and leave the cluster."""
    import ray
    if local is not None:
        local.kill()
        return
    if address and ray.is_initialized():
        try:
            if delete:
                serve.delete(APP, _blocking=False)
        finally:
            ray.shutdown()


ERROR_LINE = re.compile(r"^\s*(?:[\w.]+\.)?(\w+(?:Error|Exception)): (\S.*)$")


def start_failure(e: Exception) -> str:
    """One line for a start that failed: the error that stopped a deployment's replicas (serve.run says only
    "Failed to update the deployments [...]"; the replica's traceback is in the deployment's status message, its
    last error line the cause), else the exception's first line."""
    import ray
    why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    if not ray.is_initialized():                  # (serve.status would start a Ray instance to ask)
        return why
    try:
        deployments = serve.status().applications[APP].deployments
    except Exception:                             # noqa: BLE001 - Ray gone, or no status: the exception alone
        return why
    for name, d in deployments.items():
        causes = [m for m in map(ERROR_LINE.match, str(getattr(d, "message", "")).splitlines())
                  if m and not m.group(2).startswith("Traceback")]     # (Ray wraps the replica's in a RuntimeError)
        if causes:
            return f"{name}: {causes[-1].group(1)}: {causes[-1].group(2)}"
    return why
