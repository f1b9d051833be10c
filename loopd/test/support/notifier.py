"""
A fake inotify notifier for L{loopd.queue.watch.ConfigWatcher}, whose events the test sends:
used by the watcher's tests (L{loopd.test.test_queue_watch}) and the daemon's hot-reload
tests (L{loopd.test.test_queue_daemon}).
"""

from __future__ import annotations

from loopd.queue.watch import EventCallback


class FakeNotifier:
    """
    A notifier whose events the test sends; it can be told to refuse the watch.

    @ivar watched: each C{(directory, mask)} watched, in order.
    @ivar closed: whether the watcher closed it.
    """

    def __init__(self, refuse: Exception | None) -> None:
        """
        @param refuse: raised by L{watch}, if given: a watch the system refuses.
        """
        self.refuse = refuse
        self.watched: list[tuple[str, int]] = []
        self.callback: EventCallback | None = None
        self.closed = False

    def watch(self, directory: str, mask: int, callback: EventCallback) -> None:
        """Watch C{directory} for C{mask}, sending events to C{callback}; or refuse."""
        if self.refuse is not None:
            raise self.refuse
        self.watched.append((directory, mask))
        self.callback = callback

    def close(self) -> None:
        """Stop watching."""
        self.closed = True

    def send(self, name: str | None, mask: int) -> None:
        """Deliver one event, as inotify would: the file C{name} (None: the directory)."""
        assert self.callback is not None
        self.callback(name, mask)
