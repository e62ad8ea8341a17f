"""A TCP proxy on localhost for network faults between two real services: cut every connection
through it, refuse new ones for a while, hold one direction's bytes, or cut only the client's
side of a connection and leave the server's open and silent (a half-open partition: the server
notices only when its keepalive gives up), or delay what it forwards (a slow link)."""
from __future__ import annotations

import socket
import threading
import time

from tests.services.conftest import free_port


class TcpProxy:
    def __init__(self, target: str | None) -> None:
        """target: host:port, or None until `point_at` (a service started after the proxy,
        told the proxy's address); connections before then are closed."""
        self.target: tuple[str, int] | None = None
        if target is not None:
            self.point_at(target)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.lock = threading.Lock()
        self.links: list[_Link] = []
        self.silenced: list[socket.socket] = []  # server sides of half-open cuts, kept open
        self.refusing = False
        self.num_connections = 0  # forwarded so far
        self.holding = False  # server -> client bytes are kept back, not forwarded
        self.holding_uploads = False  # client -> server bytes likewise
        self.delay_s = 0.0  # before forwarding each read, either way
        self.listener = socket.create_server(("127.0.0.1", self.port))
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            if self.refusing or self.target is None:
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

    def point_at(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))

    def hold(self, uploads: bool = False) -> None:
        """Keep back what servers send from now on (they keep receiving what clients send);
        `uploads`: what clients send instead (the server hears nothing more, a stalled link)."""
        if uploads:
            self.holding_uploads = True
        else:
            self.holding = True

    def release(self) -> None:
        """Stop holding and forward what was held."""
        self.holding = self.holding_uploads = False
        with self.lock:
            links = list(self.links)
        for link in links:
            link.flush()

    def cut(self, refuse: bool = False, half_open: bool = False) -> None:
        """Close every connection through the proxy (also dropping any held bytes); `refuse`:
        new ones are closed at once until `accept`; `half_open`: only the client sides are
        closed, the server sides stay open and hear nothing more."""
        self.refusing = self.refusing or refuse
        with self.lock:
            links, self.links = self.links, []
        for link in links:
            link.cut(half_open)
        self.holding = self.holding_uploads = False

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
        self.held: dict[bool, list[bytes]] = {False: [], True: []}  # by from_server
        self.send_lock = threading.Lock()  # a pump and `flush` never interleave their bytes

    def start(self) -> None:
        threading.Thread(target=self._pump, args=(self.client, self.server, False),
                         daemon=True).start()
        threading.Thread(target=self._pump, args=(self.server, self.client, True),
                         daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, from_server: bool) -> None:
        while not self.done:
            try:
                data = source.recv(65536)
            except OSError:
                break
            if not data:
                break
            if self.done:
                break
            if self.proxy.delay_s:
                time.sleep(self.proxy.delay_s)
            try:
                with self.send_lock:
                    self.held[from_server].append(data)
                    if not (self.proxy.holding if from_server else self.proxy.holding_uploads):
                        self._send_held(sink, from_server)
            except OSError:
                break
        if not self.done:  # one side closed by itself: close the other as well
            self.cut(False)

    def flush(self) -> None:
        """Forward what was held, now (the side that sent it may be waiting for an answer and
        send nothing more)."""
        try:
            with self.send_lock:
                self._send_held(self.server, False)
                self._send_held(self.client, True)
        except OSError:
            self.cut(False)

    def _send_held(self, sink: socket.socket, from_server: bool) -> None:
        chunks, self.held[from_server] = self.held[from_server], []
        for chunk in chunks:
            sink.sendall(chunk)

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
