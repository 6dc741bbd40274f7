"""A real network partition between a client process and a database, on one machine.

The client runs in a network namespace of its own, joined to this one by a veth pair; a TCP
forwarder on this side of the pair passes its connections on to the database on loopback.
Taking this side's end of the pair down drops every packet both ways, as a partition does (no
reset, no FIN, nothing acknowledged): a process on loopback, or a forwarder that stops
forwarding, cannot, since the kernel still acknowledges what it is sent.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading
from collections.abc import Iterator

import pytest


class Partition:
    """The namespace ``namespace``, whose only way out is forwarders to loopback ports on
    ``host_address``."""

    def __init__(self, namespace: str, host_link: str, host_address: str) -> None:
        self.namespace = namespace
        self.host_address = host_address
        self._host_link = host_link
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    def forward(self, port: int) -> int:
        """Forward connections to ``host_address:<returned port>`` on to ``127.0.0.1:port``."""
        listener = socket.create_server((self.host_address, 0))
        self._keep(listener)
        threading.Thread(target=self._accept, args=(listener, port), daemon=True).start()
        return int(listener.getsockname()[1])

    def command(self, *argv: str) -> list[str]:
        """``argv`` run inside the client's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def cut(self) -> None:
        """Drop every packet between the namespace and this side, both ways. This side's end
        of the pair goes down: the client's stays up, its routes with it, so that the client
        sends as before and hears nothing (its own end down, it would be told at once)."""
        _ip("link", "set", self._host_link, "down")

    def heal(self) -> None:
        _ip("link", "set", self._host_link, "up")

    def close(self) -> None:
        """Close every forwarded connection (the database's end too: its sessions end)."""
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            # A thread blocked in recv() on a socket close() alone leaves it open: shut first.
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _keep(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)

    def _accept(self, listener: socket.socket, port: int) -> None:
        while True:
            try:
                client, _ = listener.accept()
                upstream = socket.create_connection(("127.0.0.1", port))
            except OSError:
                return  # closed
            self._keep(client)
            self._keep(upstream)
            for source, target in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(source, target), daemon=True).start()


def _pump(source: socket.socket, target: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            target.sendall(data)
    except OSError:
        pass
    with contextlib.suppress(OSError):
        target.shutdown(socket.SHUT_WR)


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def partitionable() -> Iterator[Partition]:
    """A client namespace joined to this one, removed after; skips where this process may not
    make one (it needs root, or CAP_NET_ADMIN, and the ``ip`` command)."""
    pid = os.getpid()
    namespace, host_link, client_link = f"itpart{pid}", f"itph{pid}", f"itpc{pid}"
    # A /30 of this process's own: runs at once (a test run beside a chaos run) never clash.
    subnet = f"10.231.{pid % 250}"
    host_address, client_address = f"{subnet}.1", f"{subnet}.2"
    partition = Partition(namespace, host_link, host_address)
    made = False
    try:
        try:
            _remove_stale_namespaces()
            _ip("netns", "add", namespace)
            made = True
            _ip("link", "add", host_link, "type", "veth", "peer", "name", client_link)
            _ip("link", "set", client_link, "netns", namespace)
            _ip("addr", "add", f"{host_address}/30", "dev", host_link)
            _ip("link", "set", host_link, "up")
            in_namespace = ("netns", "exec", namespace, "ip")
            _ip(*in_namespace, "addr", "add", f"{client_address}/30", "dev", client_link)
            _ip(*in_namespace, "link", "set", client_link, "up")
            _ip(*in_namespace, "link", "set", "lo", "up")
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            pytest.skip(f"cannot make a network namespace here (needs root and `ip`): {detail}")
        yield partition
    finally:
        partition.close()
        if made:
            # Deleting the namespace deletes the pair's end in it, and with it the pair.
            subprocess.run(["ip", "netns", "del", namespace], check=False, capture_output=True)
            subprocess.run(["ip", "link", "del", host_link], check=False, capture_output=True)


def _remove_stale_namespaces() -> None:
    """Remove the namespaces of test runs killed before they could (their links would stay)."""
    listed = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True)
    for line in listed.stdout.splitlines():
        name = line.split(" ", 1)[0]
        digits = name.removeprefix("itpart")
        if name.startswith("itpart") and digits.isdigit() and not _alive(int(digits)):
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
