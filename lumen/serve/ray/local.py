"""The local Ray instance `lumen.serve --replicas N` starts without --ray-address, and its stop, which leaves no
process of it behind.

    ray = LocalRay(num_cpus=None)   ray.init(address="local", ...) in a temp dir of its own: a new instance even
                                    when another runs on this machine (never joined: it would be stopped with ours);
                                    its processes in sessions of their own (own_sessions)
    ray.stop(grace=2.0)             serve.shutdown() and ray.shutdown(), then every process of the instance that is
                                    still there gets SIGTERM and, after `grace` seconds, SIGKILL; the temp dir goes
    ray.kill()                      every process of it at once, without waiting for Serve (a second Ctrl-C)
    ray.broken()                    what of its core has gone (the GCS's port, gcs_server, raylet), if any: every
                                    Ray call of this process then waits ~60 s for the GCS, so the caller kills

ray.shutdown() alone leaves processes: its raylet's agents (ray::DashboardAgent, ray::RuntimeEnvAgent) outlive the
raylet and ignore SIGTERM. The instance's processes are found three ways, so that none escapes: this process's
descendants started after ray.init (taken before Ray stops, while the tree is whole), the orphans of the tree
(this process is their subreaper on Linux, so they come back to it rather than to init), and any process whose
command line names the instance's temp dir.
"""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
from contextlib import contextmanager

import psutil
import ray

log = logging.getLogger("lumen.serve")
PR_SET_CHILD_SUBREAPER = 36
CORE = ("gcs_server", "raylet")         # without either, the instance cannot serve nor stop itself
# ray.shutdown() waits this long to flush task events to a GCS (5 s by default, all of it when the GCS is gone);
# they feed Ray's dashboard, which the local instance does not run
SYSTEM_CONFIG = {"task_events_shutdown_flush_timeout_ms": 500}


def _subreaper() -> None:
    """Orphaned descendants are re-parented to this process, not to init (Linux; elsewhere nothing happens)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


@contextmanager
def sigterm_kept():
    """Keep the caller's SIGTERM and SIGINT handlers while Ray starts: ray.init and its node put their own in place
    (sys.exit; a drain of up to 30 s, then sys.exit(1)), where the caller stops at once, and its driver's core
    installs a C++ one (it prints "*** SIGTERM received" before it calls the caller's): the caller's are back in
    place as it returns. Ray's Python one is kept out through Ray's private hook (where Ray has none, it is only put
    back after)."""
    main = threading.current_thread() is threading.main_thread()
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)} if main else {}
    utils = getattr(getattr(ray, "_private", None), "utils", None)
    setter = getattr(utils, "set_sigterm_handler", None)
    if setter is not None:
        utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        if setter is not None:
            utils.set_sigterm_handler = setter
        for sig, handler in saved.items():
            if handler is not None:                    # (None: not set from Python, nothing to put back)
                signal.signal(sig, handler)


@contextmanager
def own_sessions():
    """Start the processes of ray.init (its GCS, raylet, log monitor; the raylet's workers and agents inherit the
    raylet's) each in a session of its own, apart from this process's group: a signal to the group (Ctrl-C in a
    terminal, `kill -- -PGID`, a supervisor's stop of the group) then reaches this process alone, whose handler
    stops them, at any moment of the start, where Ray's core used to end this process once its raylet had the
    signal too, before anything stopped the rest. Through Ray's private Popen class; where Ray has none, nothing
    changes."""
    try:
        from ray._private import services
    except ImportError:
        services = None
    popen = getattr(services, "ConsolePopen", None)
    if popen is None:
        yield
        return

    class Popen(popen):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("start_new_session", True)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = Popen
    try:
        yield
    finally:
        services.ConsolePopen = popen


class LocalRay:
    """A Ray instance of this process's own (see the module docstring)."""

    def __init__(self, num_cpus: int | None = None, log_to_driver: bool = True):
        me = psutil.Process()
        self.before = {p.pid for p in me.children(recursive=True)}      # not Ray's
        self.core, self.ending = {}, False                                # ending: stopped on purpose
        # a short path: Ray's unix sockets live under it (at most 107 bytes)
        self.temp_dir = tempfile.mkdtemp(prefix="lumen-ray-", dir="/tmp" if os.path.isdir("/tmp") else None)
        _subreaper()
        try:                          # (to the end: a signal just after ray.init is a KeyboardInterrupt here too,
            with sigterm_kept(), own_sessions():            # and the caller, without an instance, stops none of it)
                ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=log_to_driver,
                         _temp_dir=self.temp_dir, _system_config=SYSTEM_CONFIG)
            self.core = {p: _name(p) for p in self.processes() if _name(p) in CORE}
            host, _, port = ray.get_runtime_context().gcs_address.rpartition(":")
            self.gcs = (host, int(port))
        except BaseException:
            self.kill()
            raise

    def broken(self) -> str | None:
        """What of the instance's core has gone ("gcs_server", "raylet"), or None while it is whole or being stopped
        on purpose (stop, kill). A SIGTERM to every process of the instance (systemd's stop of the unit; not one to
        this process's group: own_sessions) reaches them as it reaches this process: the GCS closes its port at once
        (its process lingers), the raylet ends seconds later."""
        if self.ending:
            return None
        for p, name in self.core.items():
            if not _live([p]):
                return name
        try:
            socket.create_connection(self.gcs, timeout=1.0).close()
        except socket.timeout:
            pass                                      # slow (a loaded host) is not gone
        except OSError:
            return "gcs_server"
        return None

    def processes(self) -> list[psutil.Process]:
        """Every live process of this instance."""
        found: dict[int, psutil.Process] = {}
        try:
            for p in psutil.Process().children(recursive=True):
                if p.pid not in self.before:
                    found[p.pid] = p
        except psutil.Error:
            pass
        for p in psutil.process_iter(["cmdline"]):
            if p.pid not in found and p.pid != os.getpid() and \
                    any(self.temp_dir in arg for arg in (p.info["cmdline"] or ())):
                found[p.pid] = p
        return list(found.values())

    def stop(self, grace: float = 2.0) -> None:
        """Stop Serve and Ray as they stop themselves, then whatever is left (SIGTERM, then SIGKILL)."""
        from ray import serve
        procs = self.processes()
        try:
            serve.shutdown()
        finally:
            self.ending = True
            try:
                ray.shutdown()
            finally:
                self._end(procs, grace)

    def kill(self, disconnect: bool = True) -> None:
        """Every process of the instance, now. Its core (the GCS and the raylet) goes last: this process leaves
        them first (ray.shutdown), which takes seconds once the GCS is gone, and ends this process (Ray's core, code
        1, before the caller's last words and the temp dir's removal) once the raylet is: its disconnect finds it
        dead. disconnect=False, for a process about to exit (os._exit): it does not leave Ray, and the core is
        killed at once after the rest."""
        self.ending = True
        procs = self.processes()
        last = [p for p in procs if _name(p) in CORE]
        psutil.wait_procs(_signal([p for p in procs if p not in last], "kill"), timeout=5.0)
        if disconnect:
            ray.shutdown()
            self._end(last, 0.0)
        else:
            _signal(last, "kill")
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _end(self, procs: list[psutil.Process], grace: float) -> None:
        """SIGTERM to procs and to the instance's processes still there, SIGKILL after `grace` seconds (0: at
        once); the temp dir goes once none is left."""
        procs = {p.pid: p for p in procs + self.processes()}
        alive = _live(procs.values())
        if alive and grace > 0:
            _, alive = psutil.wait_procs(_signal(alive, "terminate"), timeout=grace)
        alive = _live(alive)
        if alive:
            log.info("killing %d process(es) of the local Ray instance: %s", len(alive),
                     ", ".join(sorted({_name(p) for p in alive})))
            _, alive = psutil.wait_procs(_signal(alive, "kill"), timeout=5.0)
        later = [p for p in self.processes() if p.pid not in procs]     # started while it stopped
        if later:
            _, more = psutil.wait_procs(_signal(later, "kill"), timeout=5.0)
            alive += more
        alive = _live(alive)
        if alive:
            log.warning("processes of the local Ray instance still alive: %s", [p.pid for p in alive])
        else:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def _live(procs) -> list[psutil.Process]:
    """The ones still running: not gone, not a zombie (an exited process whose parent, init in some containers,
    has not reaped it: it holds nothing but its pid)."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _signal(procs: list[psutil.Process], how: str) -> list[psutil.Process]:
    """Send terminate/kill to each; the ones that were still there."""
    out = []
    for p in procs:
        try:
            getattr(p, how)()
            out.append(p)
        except psutil.NoSuchProcess:
            pass
        except psutil.Error as e:
            log.warning("cannot %s process %d: %s", how, p.pid, e)
    return out


def _name(p: psutil.Process) -> str:
    """ray::DashboardAgent, raylet, log_monitor.py, ..."""
    try:
        argv = p.cmdline() or [p.name()]
    except psutil.Error:
        return str(p.pid)
    scripts = [a for a in argv[1:] if a.endswith(".py")]
    return os.path.basename(scripts[0] if scripts and "python" in argv[0] else argv[0].split()[0])
