"""A TCP proxy on loopback, to make a database go away behind a running client and come back.

``TcpProxy(("127.0.0.1", 5432))`` listens on a free loopback port and forwards each connection
to the target. :meth:`TcpProxy.stop` closes the listener and cuts every forwarded connection
(new connections are refused, open ones are reset: the server "went away");
:meth:`TcpProxy.start` listens again on the same port (the server "came back").
:meth:`TcpProxy.hang` makes it a black hole: connections are accepted and bytes are read from
them, but nothing is forwarded either way (a server that accepts TCP and never answers, as a
stopped or wedged one does: the kernel still acknowledges the packets); :meth:`TcpProxy.resume`
forwards again.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class TcpProxy:
    def __init__(self, target: tuple[str, int], port: int = 0):
        self.target = target
        self.port = port
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self._flowing = threading.Event()
        self._flowing.set()
        self.start()

    def start(self) -> None:
        """Listen (again) on :attr:`port` and forward what arrives."""
        listener = socket.create_server(("127.0.0.1", self.port))
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def stop(self) -> None:
        """Refuse new connections and reset every open one."""
        listener, self._listener = self._listener, None
        if listener is not None:
            _shutdown(listener)  # wakes the thread blocked in accept()
            listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            _shutdown(sock)
            sock.close()

    def hang(self) -> None:
        """Accept connections and read from them, but forward nothing until :meth:`resume`."""
        self._flowing.clear()

    def resume(self) -> None:
        """Forward again (what arrived while hung is delivered then)."""
        self._flowing.set()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                args = (source, sink, self._flowing)
                threading.Thread(target=_pipe, args=args, daemon=True).start()


def _pipe(source: socket.socket, sink: socket.socket, flowing: threading.Event) -> None:
    try:
        while data := source.recv(65536):
            while not flowing.wait(0.1):
                if sink.fileno() == -1:  # closed by stop() while hung
                    return
            sink.sendall(data)
    except OSError:
        pass
    finally:
        _shutdown(source)
        _shutdown(sink)


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
