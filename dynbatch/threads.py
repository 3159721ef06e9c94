"""The threads dynbatch starts beside the user's (a trace or a compile aside, a program's
load), each kept until it ends so that ``dynbatch.reset()`` and exit can wait for it: a thread
still inside torch when the interpreter finalizes aborts the process."""

from __future__ import annotations

import threading
from typing import Callable


class Joined:
    """Daemon threads started by ``start``, waited for by ``join``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()

    def start(self, target: Callable[[], None], name: str) -> threading.Thread:
        def run() -> None:
            try:
                target()
            finally:
                with self._lock:
                    self._threads.discard(threading.current_thread())

        thread = threading.Thread(target=run, name=name, daemon=True)
        with self._lock:
            self._threads.add(thread)
        thread.start()
        return thread

    def join(self) -> None:
        """Wait for the threads running now (not the calling one)."""
        with self._lock:
            threads = [t for t in self._threads if t is not threading.current_thread()]
        for thread in threads:
            thread.join()
