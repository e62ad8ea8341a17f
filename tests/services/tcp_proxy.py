"""A TCP proxy on localhost for network faults between two real services: cut every connection
through it, refuse new ones for a while, hold one direction's bytes, or cut only the client's
side of a connection and leave the server's open and silent (a half-open partition: the server
notices only when its keepalive gives up)."""
from __future__ import annotations

import socket
import threading

from tests.services.conftest import free_port


class TcpProxy:
    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.lock = threading.Lock()
        self.links: list[_Link] = []
        self.silenced: list[socket.socket] = []  # server sides of half-open cuts, kept open
        self.refusing = False
        self.num_connections = 0  # forwarded so far
        self.holding = False  # server -> client bytes are kept back, not forwarded
        self.listener = socket.create_server(("127.0.0.1", self.port))
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            if self.refusing:
                _close(client)
                continue
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                _close(client)
                continue
            server.settimeout(None)
            link = _Link(self, client, server)
            with self.lock:
                self.links.append(link)
                self.num_connections += 1
            link.start()

    def hold(self) -> None:
        """Keep back what servers send from now on (they keep receiving what clients send)."""
        self.holding = True

    def cut(self, refuse: bool = False, half_open: bool = False) -> None:
        """Close every connection through the proxy (also dropping any held bytes); `refuse`:
        new ones are closed at once until `accept`; `half_open`: only the client sides are
        closed, the server sides stay open and hear nothing more."""
        self.refusing = self.refusing or refuse
        with self.lock:
            links, self.links = self.links, []
        for link in links:
            link.cut(half_open)
        self.holding = False

    def accept(self) -> None:
        self.refusing = False

    def close(self) -> None:
        self.closed = True
        _close(self.listener)
        self.cut()
        for sock in self.silenced:
            _close(sock)


class _Link:
    def __init__(self, proxy: TcpProxy, client: socket.socket, server: socket.socket) -> None:
        self.proxy, self.client, self.server = proxy, client, server
        self.done = False

    def start(self) -> None:
        threading.Thread(target=self._pump, args=(self.client, self.server, False),
                         daemon=True).start()
        threading.Thread(target=self._pump, args=(self.server, self.client, True),
                         daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, from_server: bool) -> None:
        held: list[bytes] = []
        while not self.done:
            try:
                data = source.recv(65536)
            except OSError:
                break
            if not data:
                break
            if self.done:
                break
            if from_server and self.proxy.holding:
                held.append(data)
                continue
            try:
                for chunk in [*held, data]:
                    sink.sendall(chunk)
            except OSError:
                break
            held.clear()
        if not self.done:  # one side closed by itself: close the other as well
            self.cut(False)

    def cut(self, half_open: bool) -> None:
        if self.done:
            return
        self.done = True
        _close(self.client)
        if half_open:
            self.proxy.silenced.append(self.server)  # open, but nothing reads or writes it
        else:
            _close(self.server)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
