"""The ZMQ side channel: prefill answers handshakes, decode asks with a bounded wait.

One request, one reply. The server never dies on a bad message (it answers an error and
keeps serving); the client never waits forever (a fresh socket per ask, closed with no
linger, so a dead peer costs exactly the timeout).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import zmq

from kvshare_connector.log import get_logger

logger = get_logger(__name__)


class SideChannelError(ConnectionError):
    """The peer could not be reached or did not answer in time."""


def zmq_address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class SideChannelServer:
    """Answers each request with ``handler(payload)`` on a background thread."""

    def __init__(self, host: str, port: int, handler: Callable[[bytes], bytes]):
        self._handler = handler
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        if ":" in host:
            self._socket.setsockopt(zmq.IPV6, 1)
        try:
            if port == 0:
                host_part = f"[{host}]" if ":" in host else host
                self.port = self._socket.bind_to_random_port(f"tcp://{host_part}")
            else:
                self._socket.bind(zmq_address(host, port))
                self.port = port
        except zmq.ZMQError as exc:
            self._socket.close()
            raise SideChannelError(f"cannot listen on {host}:{port}: {exc}") from exc
        self.host = host
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, name="kvshare-side-channel", daemon=True
        )
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._socket.recv_multipart()
            if len(frames) != 3 or frames[1] != b"":
                logger.warning("side channel: dropped a message of %d frame(s)", len(frames))
                continue
            identity, _, payload = frames
            try:
                reply = self._handler(payload)
            except Exception:  # never let one bad request stop the listener
                logger.exception("side channel: handler failed")
                continue
            self._socket.send_multipart([identity, b"", reply])
        self._socket.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def ask(host: str, port: int, payload: bytes, timeout_s: float) -> bytes:
    """Send one request and wait at most ``timeout_s`` for the reply."""
    context = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.connect(zmq_address(host, port))
        sock.send_multipart([b"", payload])
        if not sock.poll(int(timeout_s * 1000)):
            raise SideChannelError(
                f"no answer from the prefill side channel at {host}:{port} within {timeout_s:g} s"
            )
        frames = sock.recv_multipart()
    finally:
        sock.close()
    if len(frames) != 2 or frames[0] != b"":
        raise SideChannelError(f"peer at {host}:{port} answered {len(frames)} malformed frame(s)")
    return frames[1]
