"""A TCP relay in front of a real server, for the judge's tests (tests/test_judge.py): it passes every byte both ways
to the server behind it, counts the POST requests (verdicts) it passes, can hold each one back a while (a slow
judge), and can go down (its port closed, its connections cut) after a number of requests or when told, then come
back on the same port. It answers nothing itself: the client gets the server's answer, or no connection at all."""

from __future__ import annotations

import socket
import threading
import time


class Relay:
    """Relays 127.0.0.1:<port> to `target` (host, port) until stopped; `url` is its root."""

    def __init__(self, target: tuple[str, int], delay_s: float = 0.0, down_after: int | None = None) -> None:
        self.target, self.delay_s, self.down_after = target, delay_s, down_after
        self.requests, self._lock = 0, threading.Lock()
        self._open: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self.port = 0
        self.up()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        """Listen (again, on the same port once it has one)."""
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self.port, self._listener = listener.getsockname()[1], listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        """Close the port and cut every connection: the client meets a refused or reset connection."""
        with self._lock:
            sockets, self._open = [self._listener, *self._open], []
            self._listener = None
        for sock in sockets:
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # closed by down()
                return
            server = socket.create_connection(self.target)
            with self._lock:
                self._open += [client, server]
            threading.Thread(target=self._pass, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pass, args=(server, client, False), daemon=True).start()

    def _pass(self, source: socket.socket, sink: socket.socket, requests: bool) -> None:
        try:
            while chunk := source.recv(65536):
                if requests and chunk.startswith(b"POST "):  # a new request (a verdict) on this connection
                    if not self._count():
                        return
                    time.sleep(self.delay_s)
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _count(self) -> bool:
        """Count a request; False (and the relay goes down) when it is one more than down_after allows."""
        with self._lock:
            if self.down_after is not None and self.requests >= self.down_after:
                going_down = True
            else:
                self.requests, going_down = self.requests + 1, False
        if going_down:
            self.down()
        return not going_down
