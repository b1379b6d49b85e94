"""`python -m lumen.serve --model M [--host 127.0.0.1] [--port 8000] [--api-key K] [engine flags]`: an
OpenAI-compatible server (lumen.serve.app) on uvicorn.

Startup loads the model and runs one token through it (Numba's kernels compiled or loaded from its cache) before
the port opens, so the first request pays no compile. The first SIGTERM, SIGINT or SIGHUP (the terminal closed; not
under nohup, which ignores it) starts a graceful shutdown:
the port closes, new requests on open connections get 503, requests in flight have --shutdown-timeout seconds
to finish and are then aborted (each client is told, none is left hanging), and the process exits 0; a line
says how many are draining and that a second Ctrl-C stops now. A second signal aborts everything at once (the
streams end with an error event and [DONE]); a third leaves without waiting for the connections.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import socket
import sys
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from ..engine.config import EngineConfig, cli_words
from ..errors import LumenError
from ..model.store import DEFAULT_MODEL
from ..commands import Parser, check_writable, prog

log = logging.getLogger("lumen.serve")
ENGINE_FLAGS = ("threads", "adaptive_threads", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_mb",
                "enable_prefix_caching", "enable_chunked_prefill", "scheduler", "pace", "slo_ttft_s", "slo_tpot_s",
                "explain")
PD_THRESHOLD = 64              # profiling/pd_serving.py threshold: PD adds ~31 ms to TTFT, a 59-token local prefill
PD_PREFILL_TIMEOUT = 60.0
SPEC_FLAGS = ("draft_model", "num_speculative_tokens", "ngram_min", "ngram_max", "draft_vocab", "draft_quant")


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog=prog("serve"), description="An OpenAI-compatible server for a GGUF "
                                 "model: /v1/completions, /v1/chat/completions, /tokenize, /detokenize, "
                                 "/v1/models, /health, /metrics.")
    ap.add_argument("--model", "-m", default=DEFAULT_MODEL,
                    help=f"registry name (python -m lumen.models) or path to a .gguf file (default {DEFAULT_MODEL})")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    ap.add_argument("--port", type=int, default=8000, help="default 8000")
    ap.add_argument("--api-key", default=os.environ.get("LUMEN_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on every route but /health and /metrics "
                         "(default: $LUMEN_API_KEY, else none)")
    ap.add_argument("--served-model-name", help="the model id in the API (default: the --model name, or the file's "
                                                "stem for a path)")
    ap.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template to use instead of the GGUF's")
    ap.add_argument("--max-queue", type=int, default=256,
                    help="waiting requests (choices) beyond which new ones get 429 (default 256)")
    ap.add_argument("--max-n", type=int, default=64, help="largest n (choices per request, default 64)")
    ap.add_argument("--max-body-mb", type=float, default=16.0, help="largest request body (413 beyond; default 16)")
    ap.add_argument("--allowed-origins", type=allowed_origins, default=("*",), metavar="ORIGINS",
                    help="web pages (origins, comma-separated, e.g. http://localhost:3000; or a JSON list) whose "
                         "scripts may call the API from a browser (CORS); default * (any, as vLLM and "
                         "llama-server), \"\" for none")
    ap.add_argument("--max-connections", type=int, default=default_max_connections(), metavar="N",
                    help="open HTTP connections beyond which a request gets 503 (default 1024, fewer under a lower "
                         "open-file limit); a connection's headers must arrive within 20 s and fit in 64 KiB, "
                         "an idle kept-alive connection closes after 5 s")
    ap.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="seconds in-flight requests get to finish on SIGTERM/SIGINT (default 30)")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    ap.add_argument("--no-ui", action="store_true", help="no chat page at / and no dashboard at /dashboard "
                                                         "(lumen.serve.ui): their routes answer 404")
    EngineConfig.add_cli_args(ap, only=ENGINE_FLAGS)
    ap.add_argument("--profile", metavar="FILE", help="record a serving profile, written to FILE at shutdown "
                                                      "(report: python -m lumen.profile --serving FILE)")
    ry = ap.add_argument_group("scale out on Ray Serve (pip install -e '.[ray]'; lumen.serve.ray)")
    ry.add_argument("--replicas", type=int, default=1, metavar="N", help="engine replicas behind this endpoint; more than one "
                                                           "(or --ray-address) runs on Ray Serve (default 1: this "
                                                           "process alone); --threads is then per replica")
    ry.add_argument("--ray-address", metavar="ADDR", help="join this Ray cluster ('auto': the one `ray start` began here) instead of "
                                          "starting a local instance")
    ry.add_argument("--min-replicas", type=int, metavar="N",
                    help="autoscaling: fewest replicas (Ray Serve's autoscaling_config; --replicas: the first count)")
    ry.add_argument("--max-replicas", type=int, metavar="N", help="autoscaling: most replicas")
    ry.add_argument("--router", choices=["prefix", "pow2"],
                    help="prefix: to the replica caching the longest prefix unless it is overloaded; pow2: Ray "
                         "Serve's power of two choices (default prefix)")
    pd = ap.add_argument_group("disaggregated serving on Ray Serve: prompts prefilled on one pool of replicas, "
                               "decoded on another (lumen.serve.ray.pd)")
    pd.add_argument("--prefill-replicas", type=int, metavar="P", help="prefill replicas (with --decode-replicas)")
    pd.add_argument("--decode-replicas", type=int, metavar="D", help="decode replicas (with --prefill-replicas)")
    pd.add_argument("--pd-threshold", type=int, default=PD_THRESHOLD, metavar="TOKENS",
                    help="uncached prompt tokens from which a request is prefilled on the prefill pool; fewer are "
                         f"prefilled on the decode replica (default {PD_THRESHOLD}: below it, a local prefill costs "
                         "less time than the hand-off)")
    pd.add_argument("--kv-failure", choices=["recompute", "error"], default="recompute",
                    help="when a prefill replica fails during the hand-off: recompute the prompt on the decode "
                         "replica, or answer 503 (default recompute)")
    pd.add_argument("--kv-hold-timeout", type=float, default=60.0, metavar="S",
                    help="seconds a prefill replica holds a prompt's KV for the decode replica (default 60)")
    pd.add_argument("--pd-prefill-timeout", type=float, default=PD_PREFILL_TIMEOUT, metavar="S",
                    help="seconds a decode replica waits without a word from the prefill replica (it sends one "
                         "every second while the prompt is queued or prefilling) before it cancels the call and "
                         "follows --kv-failure, so a prefill replica that hangs does not hang the request "
                         f"(default {PD_PREFILL_TIMEOUT:g})")
    ap.add_argument("--tool-call-parser", choices=["hermes", "llama3", "mistral", "none"],
                    help="how tool calls are read from the model's text (default: from the chat template; none: "
                         "requests with tools get a 400 unless tool_choice is \"none\")")
    sp = ap.add_argument_group("speculative decoding (a request may choose with \"speculative\": \"ngram\" | "
                               "\"draft\" | \"none\" and \"num_speculative_tokens\")")
    sp.add_argument("--speculative", choices=["ngram", "draft"], help="the default for requests that do not say")
    EngineConfig.add_cli_args(sp, only=SPEC_FLAGS)
    return ap


def allowed_origins(text: str) -> tuple[str, ...]:
    """--allowed-origins: "*", "" (none), origins comma-separated, or vLLM's JSON list -> the origins. An empty
    origin in a list ("http://a.example," or [""]) is refused: a typo, not a way to say none."""
    import json
    from urllib.parse import urlsplit
    text = text.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError:
            items = None
        if not isinstance(items, list) or not all(isinstance(o, str) for o in items):
            raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r}")
    else:
        items = text.split(",") if text else []
    out = []
    for o in (i.strip() for i in items):
        if not o:
            raise argparse.ArgumentTypeError(f"{text!r} has an empty origin (give \"\" alone for none)")
        u = urlsplit(o)
        if o != "*" and (u.scheme not in ("http", "https") or not u.netloc or u.path not in ("", "/") or u.query):
            raise argparse.ArgumentTypeError(f"{o!r} is not an origin: give scheme://host[:port] "
                                             "(e.g. http://localhost:3000), or * for any")
        out.append(o.rstrip("/"))
    return tuple(dict.fromkeys(out))


def model_id(model: str, served_name: str | None) -> str:
    """The id clients use: --served-model-name, else the registry name, else the file's stem."""
    from ..model.store import MODELS
    if served_name:
        return served_name
    return model if model in MODELS else Path(model).stem


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server with Lumen's shutdown: the first SIGTERM/SIGINT drains the worker, a second aborts
        everything now; and no re-raised signal after the shutdown (uvicorn's way of exiting with the signal's
        code), so a graceful stop exits 0."""

        def __init__(self, config, worker, shutdown_timeout: float):
            super().__init__(config)
            self.worker, self.shutdown_timeout = worker, shutdown_timeout
            self.loop: asyncio.AbstractEventLoop | None = None
            self.signals_seen = 0

        async def serve(self, sockets=None):
            self.loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig, frame):
            if self.loop is not None:
                if self.should_exit:
                    if self.signals_seen >= 2:               # a third: leave without waiting for anything
                        self.force_exit = True
                    self.loop.call_soon_threadsafe(self.worker.abort_all, 503, "the server is shutting down now")
                else:
                    self.loop.call_soon_threadsafe(self.drain, sig)
            self.signals_seen += 1
            self.should_exit = True

        def drain(self, sig: int) -> None:
            """The first signal, on the event loop: say what the wait is and how to end it (the same signal again:
            Ctrl-C at a terminal, `kill` from a supervisor), then drain."""
            n = len(self.worker.submissions())
            if n:
                again = ("press Ctrl-C again" if sig == signal.SIGINT
                         else f"send {signal.Signals(sig).name} again")
                log.warning("shutting down: draining %d in-flight request%s (up to %.0f s); %s to stop now", n,
                            "s" * (n != 1), self.shutdown_timeout, again)
            else:
                log.info("shutting down: nothing in flight")
            self.worker.drain(self.shutdown_timeout)

        @contextmanager
        def capture_signals(self):
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in stop_signals()}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server


@dataclass(frozen=True)
class HttpLimits:
    """What one connection may take of the server, so that slow, idle or hostile clients cannot starve the others
    of sockets or memory (uvicorn bounds none of these by itself: a connection that never sends, or sends its
    headers a byte at a time, stays open for ever, and httptools buffers headers without end).

    head_timeout: seconds a request's line and headers may take, from the connection's opening or the first byte
        of a request after the previous one (a deadline, not an idle timer: slowloris sends a byte a second); then
        408 and the connection closes (closed silently if nothing came). Apache's mod_reqtimeout allows 20-40 s.
    keep_alive: idle seconds between requests on a kept-alive connection (uvicorn's and vLLM's 5).
    max_head_bytes: the request line and headers (431 past it); llama-server allows 8 KiB a line, h11 16 KiB.
    max_connections: open connections; past them a new connection gets 503 (OpenAI's error shape, Retry-After)
        and is closed, without its request being read."""
    head_timeout: float = 20.0
    keep_alive: float = 5.0
    max_head_bytes: int = 64 * 1024
    max_connections: int = 1024


LINGER_S = 2.0         # how long a connection refused mid-request is read (and dropped) before it closes
UNREAD_BYTES = 2 ** 20  # of a body answered before it came, dropped before the connection closes (after LINGER_S)


def default_max_connections() -> int:
    """1024, or fewer where the open-file limit would be reached first (then accept() fails without an answer)."""
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return HttpLimits.max_connections
    return HttpLimits.max_connections if soft == resource.RLIM_INFINITY else max(16, min(1024, soft - 64))


def _limit_reply(status: int, reason: str, message: str, extra: str = "") -> bytes:
    from . import protocol as P
    from .responses import dumps
    body = dumps(P.error_body(status, message)).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{extra}connection: close\r\n\r\n").encode() + body


def guarded_protocol(base: type, limits: HttpLimits) -> type:
    """uvicorn's HTTP protocol class `base` (httptools' or h11's) with a deadline and a size bound on each request's
    head (HttpLimits). A head is being read from the connection's opening, and from the first byte after a
    response, until uvicorn makes the request's cycle (its headers are complete)."""

    class Guarded(base):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_bytes, self._head_timer, self._dropping, self._unread, self._body_open = 0, None, False, 0, False
            if len(self.connections) > limits.max_connections:        # (this one included)
                self._refuse(_limit_reply(503, "Service Unavailable", f"the server has {limits.max_connections} "
                                          "connections open, its most; try again later", "retry-after: 1\r\n"))
                return
            self._arm_head()

        def _arm_head(self) -> None:
            self._head_bytes = self._unread = 0
            self._head_tail = b""                    # the head's last 3 bytes so far (its end may span two reads)
            self._head_timer = self.loop.call_later(limits.head_timeout, self._head_late)

        def _head_done(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _refuse(self, reply: bytes) -> None:
            """Answer and close; what the client still sends meanwhile is read and dropped for a moment (a lingering
            close), since closing on unread data resets the connection and the client would lose the answer."""
            self._head_done()
            if self.transport.is_closing():
                return
            self._dropping = True
            self.transport.write(reply)
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)

        def _head_late(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            if self._head_bytes == 0:                # nothing asked: close, as uvicorn's keep-alive timeout does
                self.transport.close()
                return
            self.logger.warning("%s: the request's headers took over %g s; closing", _who(self), limits.head_timeout)
            self._refuse(_limit_reply(408, "Request Timeout",
                                      f"the request's headers took longer than {limits.head_timeout:g} s"))

        def data_received(self, data: bytes) -> None:
            if self._dropping:
                return
            answered = self.cycle is None or self.cycle.response_complete
            if answered and self._in_body():         # the rest of a body answered before it came (a 401): uvicorn
                self._unread += len(data)            # drops it; past UNREAD_BYTES, for LINGER_S more at most
                if self._unread > UNREAD_BYTES:
                    self._dropping = True
                    self.loop.call_later(LINGER_S, self.transport.close)
                    return
                if self._head_timer is None:         # and it has head_timeout to end, as a head has (a drip of it
                    self._head_timer = self.loop.call_later(limits.head_timeout, self._head_late)   # would not)
                super().data_received(data)
                if not self._in_body():
                    self._head_done()
                return
            if self._head_timer is None and answered:
                self._arm_head()                     # a new request after the previous one's response
            reading = self._head_timer is not None
            if reading:                              # the head's bytes in data: up to its blank line, if here
                joined = self._head_tail + data      # (checked before the parser sees them: past it, the request
                end = joined.find(b"\r\n\r\n")        # would be on its way to the app)
                over = self._head_bytes + (len(data) if end < 0 else end + 4 - len(self._head_tail)) \
                    > limits.max_head_bytes
                self._head_bytes += len(data)
                if over:
                    self._too_large()
                    return
                self._head_tail = joined[-3:]
            before = self.cycle
            super().data_received(data)
            if not reading or self.transport.is_closing():
                return
            if self.cycle is not before:             # the headers are complete (the rest of data may be body)
                self._head_done()

        def _too_large(self) -> None:
            self.logger.warning("%s: request headers over %d bytes; closing", _who(self), limits.max_head_bytes)
            self._refuse(_limit_reply(431, "Request Header Fields Too Large", "the request line and headers are "
                                      f"larger than {limits.max_head_bytes} bytes"))

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to a request its parser rejects, in OpenAI's error shape, closed as _refuse closes
            (uvicorn's own is plain text, closed at once: the client may lose it under what it still sends)."""
            self.logger.warning("%s: %s", _who(self), msg)
            self._refuse(_limit_reply(400, "Bad Request", f"{msg.rstrip('.')} (malformed HTTP)"))

        def _in_body(self) -> bool:
            """The client is sending a request's body: what it sends now is no head."""
            conn = getattr(self, "conn", None)
            if conn is not None:                     # h11's
                import h11
                return conn.their_state is h11.SEND_BODY
            return self._body_open

        def on_headers_complete(self) -> None:       # httptools' parser callbacks (h11's protocol has none)
            super().on_headers_complete()
            self._body_open = True

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._body_open = False

        def connection_lost(self, exc) -> None:
            self._head_done()
            super().connection_lost(exc)

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded


def _who(protocol) -> str:
    client = getattr(protocol, "client", None)
    return f"{client[0]}:{client[1]}" if client else "a client"


def uvicorn_config(app, *, host: str, port: int, shutdown_timeout: float, log_level: str = "info",
                   limits: HttpLimits = HttpLimits(), http: str = "auto"):
    """uvicorn's Config for the app, with the HttpLimits on every connection. http: uvicorn's HTTP parser, "auto"
    (httptools' when it is installed, else h11's), "httptools" or "h11"."""
    import uvicorn
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string
    base = import_from_string(HTTP_PROTOCOLS[http])
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                          timeout_graceful_shutdown=shutdown_timeout + 5, http=guarded_protocol(base, limits),
                          timeout_keep_alive=limits.keep_alive,     # h11's own bound, behind ours by a read (256 KiB):
                          h11_max_incomplete_event_size=limits.max_head_bytes + 2 ** 18)   # ours answers 431 first


def serve(app, worker, *, host: str, port: int, shutdown_timeout: float, log_level: str = "info",
          limits: HttpLimits = HttpLimits()) -> None:
    """Run the app until a signal stops it (see the module docstring)."""
    config = uvicorn_config(app, host=host, port=port, shutdown_timeout=shutdown_timeout, log_level=log_level,
                            limits=limits)
    _server_class()(config, worker, shutdown_timeout).run()


def _interrupt(sig, frame):
    raise KeyboardInterrupt


def stop_signals() -> tuple:
    """The signals that stop the server gracefully: SIGINT, SIGTERM and SIGHUP (its default action would kill the
    process with its requests in flight), unless SIGHUP is ignored (nohup): then it stays ignored."""
    hup = () if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else (signal.SIGHUP,)
    return (signal.SIGINT, signal.SIGTERM, *hup)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    for name in ("max_queue", "max_n", "max_connections"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 0 < args.max_body_mb < 1e6:
        ap.error(f"--max-body-mb must be a positive number of megabytes, got {args.max_body_mb}")
    if not 0 <= args.shutdown_timeout < 1e6:                 # (nan too)
        ap.error(f"--shutdown-timeout must be a number of seconds, 0 or more, got {args.shutdown_timeout}")
    if not 1 <= args.port <= 65535:                    # (getaddrinfo wraps 70000 to 4464 without a word)
        ap.error(f"--port must be between 1 and 65535, got {args.port}")
    for flag, value in (("--api-key", args.api_key), ("--served-model-name", args.served_model_name)):
        if value is not None and not value.strip():    # ("$KEY" unset: an empty key, not none)
            ap.error(f"{flag} must not be empty")
    if args.profile is not None:                       # now, not at shutdown after the whole run
        why = check_writable(args.profile, "the serving profile") if args.profile.strip() else \
            "--profile needs a file name"
        if why:
            ap.error(why)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.speculative == "draft" and not args.draft_model:
        ap.error("--speculative draft needs --draft-model")
    if args.scheduler in ("paced", "fcfs") and (args.slo_ttft_s is not None or args.slo_tpot_s is not None):
        ap.error(f"--slo-ttft-ms and --slo-tpot-ms are targets of the measured scheduler, not of --scheduler "
                 f"{args.scheduler} (leave --scheduler out, or give --scheduler measured)")
    slo = args.slo_ttft_s is not None or args.slo_tpot_s is not None
    scheduler = args.scheduler or ("measured" if slo else "paced")
    if scheduler != "paced" and args.pace != EngineConfig.pace:
        ap.error(f"--pace sets the paced scheduler, not the {scheduler} one (leave --pace out, or the "
                 f"{'SLO targets' if args.scheduler is None else '--scheduler'})")
    try:
        config = EngineConfig.from_cli_args(args)
    except ValueError as e:
        ap.error(str(e))
    try:
        if config.max_model_len is not None:
            config.check_unchunked(config.max_model_len)
    except ValueError as e:
        ap.error(cli_words(str(e)))
    if config.threads is not None:                     # now, not after loading the model
        import numba
        if config.threads > numba.config.NUMBA_NUM_THREADS:
            ap.error(f"--threads must be between 1 and {numba.config.NUMBA_NUM_THREADS}, got {config.threads}")
    pd_error = _pd_flags_error(args)
    if pd_error:
        ap.error(pd_error)
    if args.prefill_replicas is not None:
        config = replace(config, kv_hold_timeout_s=args.kv_hold_timeout)
    try:                                               # a file that cannot be a template: a usage error, now
        args.template = read_template(args.chat_template)
    except LumenError as e:
        ap.error(cli_words(str(e)))
    if args.replicas != 1 or args.ray_address or args.min_replicas is not None or args.max_replicas is not None \
            or args.prefill_replicas is not None:
        args.router = args.router or "prefix"
        try:
            return _main_ray(ap, args, config)
        except KeyboardInterrupt:            # a signal before Ray's start took the signals over, as one process
            print("stopped before serving", file=sys.stderr)
            return 0
    if args.router:
        ap.error("--router chooses among replicas: give --replicas N (more than 1), --ray-address, or "
                 "--prefill-replicas and --decode-replicas")
    why = bind_error(args.host, args.port)             # now, not after loading the model
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 1
    for sig in stop_signals()[1:]:                     # until uvicorn takes the signals over: stop loading (not
        signal.signal(sig, _interrupt)
    from rich.console import Console                   # earlier: within an import it became an ImportError)
    from ..generate import status_while_compiling
    try:
        template = args.template
        name = model_id(args.model, args.served_model_name)
        with status_while_compiling(Console(stderr=True, highlight=False)):    # the port opens after it
            from .app import load_engine, make_app     # (in the block: some kernels compile as they import)
            engine = load_engine(args.model, config)
        app, worker = make_app(engine, model_name=name, chat_template=template, api_key=args.api_key,
                               max_queue=args.max_queue, max_n=args.max_n,
                               max_body_bytes=int(args.max_body_mb * 2 ** 20), speculative=args.speculative,
                               profile_path=args.profile, ui=not args.no_ui,
                               tool_call_parser=args.tool_call_parser, allowed_origins=args.allowed_origins)
    except (LumenError, ValueError, OSError) as e:
        print(f"error: {cli_words(str(e))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopped before serving", file=sys.stderr)
        return 0
    s = engine.stats()
    log.info("serving %r (%s) on http://%s:%d: %d threads, max_model_len %d, %d KV blocks, max_num_seqs %d%s",
             name, engine.parts.path, args.host, args.port, engine.threads, engine.max_model_len, s["kv_blocks"],
             engine.max_num_seqs, ", API key required" if args.api_key else "")
    if not args.no_ui:
        log.info("chat at http://%s:%d/, live dashboard at http://%s:%d/dashboard", args.host, args.port,
                 args.host, args.port)
    # What loading made lives as long as the server: out of the collector's reach, a full collection (0.2 s with
    # SmolLM2, the loop and the engine thread stopped) no longer walks it, during serving or at exit.
    gc.collect()
    gc.freeze()
    try:
        serve(app, worker, host=args.host, port=args.port, shutdown_timeout=args.shutdown_timeout,
              log_level=args.log_level, limits=HttpLimits(max_connections=args.max_connections))
    except KeyboardInterrupt:                          # a signal before uvicorn took them over: nothing in flight
        pass
    log.info("stopped")
    return 0


def read_template(path: str | None) -> str | None:
    """The text of --chat-template FILE (None without it); LumenError naming the flag and the file."""
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise LumenError(f"--chat-template {path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise LumenError(f"--chat-template {path}: not UTF-8 ({e.reason} at byte {e.start})") from None
    if not text.strip():                               # (every chat would be an empty prompt)
        raise LumenError(f"--chat-template {path} is empty")
    from ..format.chat import compile_template
    try:
        compile_template(text)
    except LumenError as e:
        raise LumenError(f"--chat-template {path}: {e}") from None
    return text


def bind_error(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port (a port in use, a host that does not resolve or is not this
    machine's), or None. Checked before the model loads, so such a mistake fails at once."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)       # as uvicorn binds
            s.bind(addr)
    except OSError as e:                               # (socket.gaierror too)
        return f"cannot listen on {host}:{port}: {e.strerror or e}"
    return None


def _pd_flags_error(args) -> str | None:
    """What is wrong with the disaggregated-serving flags, in one line (None: nothing)."""
    p, d = args.prefill_replicas, args.decode_replicas
    if p is None and d is None:
        if args.pd_threshold != PD_THRESHOLD or args.kv_failure != "recompute" or args.kv_hold_timeout != 60.0 \
                or args.pd_prefill_timeout != PD_PREFILL_TIMEOUT:
            return "--pd-threshold, --pd-prefill-timeout, --kv-failure and --kv-hold-timeout need --prefill-replicas " \
                   "and --decode-replicas"
        return None
    if p is None or d is None:
        return "--prefill-replicas and --decode-replicas go together"
    if p < 1 or d < 1:
        return "--prefill-replicas and --decode-replicas must be at least 1"
    if args.replicas != 1 or args.min_replicas is not None or args.max_replicas is not None:
        return "--prefill-replicas/--decode-replicas size the pools: leave out --replicas, --min-replicas and " \
               "--max-replicas"
    if args.pd_threshold < 0:
        return "--pd-threshold must not be negative"
    if not 0 < args.kv_hold_timeout < 1e6:
        return "--kv-hold-timeout must be a positive number of seconds"
    if not 0 < args.pd_prefill_timeout < 1e6:
        return "--pd-prefill-timeout must be a positive number of seconds"
    return None


def _main_ray(ap: argparse.ArgumentParser, args, config: EngineConfig) -> int:
    """--replicas N / --ray-address: the same server as a Ray Serve application (lumen.serve.ray)."""
    if args.max_connections != default_max_connections():
        ap.error("--max-connections caps this process's own HTTP server; with --replicas, --ray-address or "
                 "--prefill-replicas, Ray Serve's proxy takes the connections (leave it out)")
    if args.replicas < 1 or any(v is not None and v < 1 for v in (args.min_replicas, args.max_replicas)):
        ap.error("--replicas, --min-replicas and --max-replicas must be at least 1")
    if args.min_replicas is not None and args.max_replicas is not None and args.min_replicas > args.max_replicas:
        ap.error("--min-replicas must not exceed --max-replicas")
    if args.replicas != 1 and args.min_replicas is not None and args.replicas < args.min_replicas:
        ap.error(f"--replicas {args.replicas} (the replicas started first) must not be below --min-replicas "
                 f"{args.min_replicas}")
    if args.max_replicas is not None and args.replicas > args.max_replicas:
        ap.error(f"--replicas {args.replicas} (the replicas started first) must not exceed --max-replicas "
                 f"{args.max_replicas}")
    if args.profile:
        ap.error("--profile records one process; it does not work with --replicas")
    from .app import Settings
    try:
        from .ray import app as ray_app
    except ImportError as e:
        print(f"error: --replicas needs Ray Serve (pip install -e '.[ray]'): {e}", file=sys.stderr)
        return 1
    scale = ray_app.Scale(replicas=args.replicas, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                          router=args.router)
    pools = args.prefill_replicas + args.decode_replicas if args.prefill_replicas else scale.initial
    most = scale.bounds[1] if scale.bounds else pools     # the CPUs shared by the most replicas there will be
    from ..cpu import usable_cpus                     # (the CPUs this process may use: taskset, a cgroup quota)
    threads = args.threads or max(1, usable_cpus() // most)
    config = replace(config, threads=threads)
    try:
        from ..model.parts import open_gguf
        from ..model.store import resolve
        from ..engine.engine import served_model_len
        _, model_config = open_gguf(resolve(args.model))       # a bad --model fails here, before Ray starts,
        served, _ = served_model_len(replace(config, fit_model_len=True), model_config)   # and so does a context
        config.check_unchunked(served)                 # the replicas would refuse (load_engine's checks)
        if args.draft_model:                           # and a --draft-model that is not there
            open_gguf(resolve(args.draft_model))
        template = args.template
    except (LumenError, ValueError, OSError) as e:
        print(f"error: {cli_words(str(e))}", file=sys.stderr)
        return 1
    why = None if args.ray_address else bind_error(args.host, args.port)   # our local instance's proxy binds here
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 1
    settings = Settings(model_id=model_id(args.model, args.served_model_name), api_key=args.api_key,
                        max_body_bytes=int(args.max_body_mb * 2 ** 20), max_n=args.max_n, speculative=args.speculative,
                        ui=not args.no_ui, tool_call_parser=args.tool_call_parser,
                        allowed_origins=args.allowed_origins)
    if args.prefill_replicas:
        from .ray import pd
        pd_settings = pd.PDSettings(args.pd_threshold, args.kv_failure, prefill_timeout_s=args.pd_prefill_timeout)
        app = pd.build_pd(args.model, config, settings, pd_settings,
                          prefill_replicas=args.prefill_replicas, decode_replicas=args.decode_replicas,
                          router=args.router, max_queue=args.max_queue, chat_template=template,
                          shutdown_timeout=args.shutdown_timeout)
    else:
        app = ray_app.build(args.model, config, settings, scale=scale, max_queue=args.max_queue,
                            chat_template=template, shutdown_timeout=args.shutdown_timeout)
    for sig in stop_signals()[1:]:                 # until serve_on_ray takes the signals over; not earlier: within
        signal.signal(sig, _interrupt)
    from .. import warmup                         # an import (Ray's, Numba's) it became an ImportError and a traceback
    # the warm-up compiles and packs while Ray starts (not for a cluster's other hosts)
    requant = args.draft_model and config.speculative.draft_quant is not None    # a draft loads requantized
    models = [args.model] + ([args.draft_model] if args.draft_model and not requant else [])
    warming = None if args.ray_address else warmup.in_background(models, threads,
                                                                 drafts=[args.draft_model] if requant else [])
    try:
        return ray_app.serve_on_ray(app, host=args.host, port=args.port, address=args.ray_address,
                                    replicas=pools, threads=threads,
                                    max_replicas=scale.bounds[1] if scale.bounds else None,
                                    signals=stop_signals())
    finally:
        warmup.stop(warming)
