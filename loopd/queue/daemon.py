# -*- test-case-name: loopd.test.test_queue_daemon,test.test_queue_daemon_e2e -*-
"""
The lease daemon behind C{twist llmqueue}: one scheduler served on C{<agent dir>/llm-queue.sock}.

It ties the pieces together (seed, "Hot-reload", "logFile", "Idle-exit"; DESIGN §3 decisions
9-14 and 25-27):

 - the policy comes from C{<agent dir>/llm-queue.json}: missing is the defaults, invalid is the
   defaults with every violation on stderr; C{--models-json} maps provider names to endpoints;
 - the socket is listened on with mode 0600 in a 0700 directory; a stale one is reclaimed, a
   live one means another daemon won the race and this one exits 0 with one line on stderr; a
   path too long for the platform is a non-zero exit with the reason, and no socket;
 - the config file is watched: a valid edit is applied to the live queues (holders and waiters
   move with their queue), an invalid one is printed to stderr and the last good config kept, a
   half-written one (not JSON) is kept silently, a deleted file is the defaults;
 - queue events go to the C{logFile} the current policy names, best effort;
 - the daemon exits C{daemonIdleExitMs} after its last counted client left (a 30 s floor when
   no client ever came), unlinking its socket; SIGTERM does the same.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import TextIO

from twisted.application.service import Service
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.error import ReactorNotRunning
from twisted.internet.interfaces import IDelayedCall, IListeningPort
from twisted.logger import Logger

from loopd.queue.eventlog import EventLog
from loopd.queue.host import QueueHost
from loopd.queue.paths import config_path, socket_path
from loopd.queue.policy import Policy
from loopd.queue.protocol import LeaseFactory, deliver_grant
from loopd.queue.scheduler import Scheduler
from loopd.queue.watch import ConfigWatcher, NotifierFactory
from loopd.reactor import IServiceReactor
from loopd.unixsocket import SocketInUseError, UnixSocketError, listen_unix

__all__ = [
    "MAX_IDLE_EXIT_MS",
    "NO_CLIENT_FLOOR_MS",
    "LlmQueueService",
    "idle_exit_delay_ms",
]

_log = Logger()

#: The longest idle-exit delay: C{setTimeout}'s cap (2^31-1 ms, about 24.8 days).
MAX_IDLE_EXIT_MS = 2**31 - 1
#: The least delay before a daemon that no client ever reached exits.
NO_CLIENT_FLOOR_MS = 30_000


def idle_exit_delay_ms(configured_ms: int, never_had_client: bool) -> int:
    """
    Return the idle-exit delay: C{daemonIdleExitMs}, at least L{NO_CLIENT_FLOOR_MS} when no
    client has come yet, and never more than L{MAX_IDLE_EXIT_MS}.
    """
    delay = max(configured_ms, NO_CLIENT_FLOOR_MS) if never_had_client else configured_ms
    return min(max(delay, 0), MAX_IDLE_EXIT_MS)


_RELOADED = {
    "rejected": "llmqueue: reload: rejected {path}, keeping the last good config",
    "unchanged": "llmqueue: reload: no change in {path}",
    "applied": "llmqueue: reload: applied {path}",
}


def _say(stream: TextIO, line: str) -> None:
    """
    Write one line to C{stream} and flush it (a pipe would hold it back otherwise).
    """
    stream.write(line + "\n")
    stream.flush()


class LlmQueueService(Service):
    """
    The lease daemon: listens, schedules, watches its config, logs events and exits when idle.

    @ivar host: the scheduler with its policy, catalog and sweep.
    @ivar factory: the L{LeaseFactory} on the socket (it counts the clients).
    @ivar watcher: the L{ConfigWatcher} on the config file.
    """

    _port: IListeningPort | None = None
    _idle: IDelayedCall | None = None

    def __init__(
        self,
        reactor: IServiceReactor,
        agent_dir: str,
        sweep_ms: int,
        models_json: str | None,
        stderr: TextIO,
        exit: Callable[[int], object],
        *,
        stdout: TextIO | None = None,
        notifier_factory: NotifierFactory | None = None,
        wall_time: Callable[[], float] = time.time,
        handle_sigterm: bool = False,
    ) -> None:
        """
        Read the config and the models catalog (their problems are printed at start) and
        build the scheduler.

        @param reactor: provides C{IReactorUNIX}, C{IReactorTime} and C{IReactorCore}.
        @param agent_dir: the directory of the socket and the config file.
        @param sweep_ms: the scheduler's sweep period.
        @param models_json: the models catalog's path, or C{None} for an empty catalog.
        @param stderr: receives violations and the reason of a failed start.
        @param exit: ends the process with a status when the daemon cannot start
            (C{sys.exit}); if it returns, the service simply does not start.
        @param stdout: receives the start line (default: C{sys.stdout} at start).
        @param notifier_factory: the config watch's notifier (inotify when C{None}).
        @param wall_time: the clock of the event log's C{ts}.
        @param handle_sigterm: make SIGTERM a clean stop with status 0 (C{twist} itself
            would re-raise the signal after shutdown).
        """
        super().__init__()
        self._reactor = reactor
        self._stderr = stderr
        self._stdout = stdout
        self._exit = exit
        self._handle_sigterm = handle_sigterm
        self.socket_path = socket_path(agent_dir)
        self.config_path = config_path(agent_dir)
        self._had_client = False
        self.event_log = EventLog(lambda: self.host.log_path(), wall_time)
        self.host = QueueHost(
            reactor,
            deliver_grant,
            config_path=self.config_path,
            models_json=models_json,
            sweep_ms=sweep_ms,
            on_event=self.event_log.write,
        )
        self.factory = LeaseFactory(self.host.scheduler, on_clients=self._clients_changed)
        self.watcher = ConfigWatcher(
            reactor, self.config_path, self.reload, notifier_factory=notifier_factory
        )

    @property
    def policy(self) -> Policy:
        """The config in force (the last good one)."""
        return self.host.policy

    @property
    def scheduler(self) -> Scheduler:
        """The one scheduler every connection talks to."""
        return self.host.scheduler

    # -- lifecycle ---------------------------------------------------------------------

    def startService(self) -> None:
        """
        Listen, report the config's problems, watch the config, arm the no-client idle
        exit, then print the start line. A live socket exits 0; any other listen failure
        exits 1.
        """
        try:
            self._port = listen_unix(self._reactor, self.socket_path, self.factory)
        except SocketInUseError as e:
            _say(self._stderr, f"llmqueue: {e}; leaving it to that daemon")
            self._exit(0)
            return
        except UnixSocketError as e:
            _say(self._stderr, f"llmqueue: {e}")
            self._exit(1)
            return
        super().startService()
        for problem in self.host.problems:
            _say(self._stderr, problem)
        if self.host.config_invalid:
            _say(self._stderr, "llmqueue: serving with the default config")
        self.host.start()
        self.watcher.start()
        if self.factory.clients == 0:
            self._arm_idle_exit()
        if self._handle_sigterm:
            self._reactor.callWhenRunning(self._install_sigterm)
        # Last: whoever waits for this line may edit the config at once.
        _say(self._stdout or sys.stdout, f"llmqueue: listening on {self.socket_path}")

    def stopService(self) -> Deferred[None] | None:
        """
        Stop the idle timer and the watch, and stop listening; the socket file is gone when
        the returned Deferred fires.
        """
        super().stopService()
        self._cancel_idle_exit()
        self.watcher.stop()
        self.host.stop()
        port, self._port = self._port, None
        if port is None:
            return None
        return port.stopListening()

    # -- hot reload --------------------------------------------------------------------

    def reload(self) -> None:
        """
        Re-read the config file (the watcher's C{on_change}): apply a valid change to the
        live queues; keep the last good config on an invalid file (its violations go to
        stderr) or a half-written one (silently); a deleted file is the defaults.
        """
        outcome, problems = self.host.reload()
        for problem in problems:
            _say(self._stderr, problem)
        _log.info(_RELOADED[outcome], path=self.config_path)

    # -- idle exit ---------------------------------------------------------------------

    def _clients_changed(self, count: int) -> None:
        """
        The factory's client count changed: a counted client cancels a pending exit; the
        last one leaving (a close or C{bye}) arms it.
        """
        if count > 0:
            self._had_client = True
            self._cancel_idle_exit()
        else:
            self._arm_idle_exit()

    def _arm_idle_exit(self) -> None:
        """
        Start the idle-exit timer with the delay the current policy gives.
        """
        self._cancel_idle_exit()
        delay = idle_exit_delay_ms(self.policy.defaults.daemon_idle_exit_ms, not self._had_client)
        self._idle = self._reactor.callLater(delay / 1000.0, self._idle_exit)

    def _cancel_idle_exit(self) -> None:
        """
        Drop a pending idle exit, if any.
        """
        idle, self._idle = self._idle, None
        if idle is not None and idle.active():
            idle.cancel()

    def _idle_exit(self) -> None:
        """
        No counted client is left: stop listening (the socket file goes), then stop.
        """
        self._idle = None
        _log.info("llmqueue: no client left; exiting")
        port, self._port = self._port, None
        if port is None:
            self._stop_reactor()
        else:
            maybeDeferred(port.stopListening).addBoth(lambda _: self._stop_reactor())

    def _stop_reactor(self) -> None:
        """
        Stop the reactor unless it is already stopping.
        """
        try:
            self._reactor.stop()
        except ReactorNotRunning:
            pass

    # -- SIGTERM -----------------------------------------------------------------------

    def _install_sigterm(self) -> None:
        """
        Take SIGTERM over from the reactor, which would make C{twist} die by the signal
        after shutdown: here it is a clean stop that exits 0 (DESIGN §27).
        """
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, number: int, frame: FrameType | None) -> None:
        """
        The SIGTERM handler: stop the reactor from its own thread; stopping the service
        removes the socket.
        """
        self._reactor.callFromThread(self._stop_reactor)
