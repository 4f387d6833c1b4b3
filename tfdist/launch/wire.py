"""The wire between the launchers of a multi-node job: signed JSON messages over TCP.

Node 0 (the master) and every node's launcher talk over one TCP connection each. The
job's token never crosses the wire: on connecting, the master sends a random nonce,
the node answers with its own nonce and its hello signed with HMAC-SHA256 under the
token, and the master answers with a proof that it knows the token too. Both then sign
every message with a key derived from the token and both nonces, numbering messages so
none can be replayed or dropped unnoticed. A connection that cannot sign (a port
scanner, a node with another token, a stray client) is refused before it can join.
Messages are not encrypted: run the job on a network you trust (README).

Frames are a 4-byte big-endian length and a body; a frame over 1 MiB is refused. The
master gives a connection ``HANDSHAKE_SECONDS`` in all to prove itself, and answers a
malformed hello with a refusal. Standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import re
import struct
import threading
import time

from tfdist.errors import WireError

PROTOCOL = "tfdist-nodes/1"
MAX_FRAME = 1 << 20
HANDSHAKE_SECONDS = 10.0
_HEX_MAC = re.compile(r"[0-9a-f]{64}")
_NONCE = re.compile(r"[0-9a-f]{1,64}")
_LENGTH = struct.Struct(">I")
_MAC_SIZE = hashlib.sha256().digest_size


class Refused(WireError):
    """The other side refused this connection; the message says why."""


class Foreign(WireError):
    """What answered does not speak this protocol."""


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"\0".join(parts), hashlib.sha256).digest()


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(payload)) + payload)


def _recv_exact(sock: socket.socket, size: int, deadline: float | None = None) -> bytes:
    chunks, left = [], size
    while left:
        if deadline is not None:
            if time.monotonic() >= deadline:
                raise WireError("timed out waiting for the other side")
            sock.settimeout(deadline - time.monotonic())
        try:
            chunk = sock.recv(left)
        except socket.timeout:
            raise WireError("timed out waiting for the other side") from None
        except OSError as err:
            raise WireError(f"connection lost ({err.strerror or err})") from None
        if not chunk:
            raise WireError("connection closed by the other side")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv_frame(sock: socket.socket, deadline: float | None = None) -> bytes:
    (size,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size, deadline))
    if size > MAX_FRAME:
        raise WireError(f"a frame of {size} bytes is not this protocol")
    return _recv_exact(sock, size, deadline)


def _recv_json(sock: socket.socket, deadline: float | None = None) -> dict:
    try:
        message = json.loads(_recv_frame(sock, deadline))
    except (ValueError, UnicodeDecodeError):
        raise WireError("received a frame that is not JSON") from None
    if not isinstance(message, dict):
        raise WireError("received JSON that is not an object")
    return message


def _send_json(sock: socket.socket, message: dict) -> None:
    _send_frame(sock, json.dumps(message, sort_keys=True).encode())


class Channel:
    """A signed, numbered message stream over one connected socket; ``send`` is thread-safe."""

    def __init__(self, sock: socket.socket, key: bytes, me: str, peer: str, description: str):
        self.sock, self.key, self.me, self.peer = sock, key, me.encode(), peer.encode()
        self.description = description  # "10.0.0.2:41234" or "the master at 10.0.0.1:29400"
        self._sent = self._received = 0
        self._lock = threading.Lock()

    def send(self, body: dict) -> None:
        """Signs and sends ``body``; raises WireError when the connection is gone."""
        with self._lock:
            payload = json.dumps(body, sort_keys=True).encode()
            mac = _mac(self.key, self.me, str(self._sent).encode(), payload)
            self._sent += 1
            try:
                _send_frame(self.sock, mac + payload)
            except OSError as err:
                raise WireError(f"connection lost ({err.strerror or err})") from None

    def recv(self, timeout: float | None = None) -> dict:
        """The next message; WireError on a closed connection, a timeout or a bad signature."""
        try:
            self.sock.settimeout(timeout)
        except OSError:  # closed by this side meanwhile
            raise WireError("connection closed by this side") from None
        frame = _recv_frame(self.sock)
        mac, payload = frame[:_MAC_SIZE], frame[_MAC_SIZE:]
        if not hmac.compare_digest(mac, _mac(self.key, self.peer, str(self._received).encode(), payload)):
            raise WireError(f"a message from {self.description} failed its signature check")
        self._received += 1
        return json.loads(payload)

    def finish(self) -> None:
        """Half-closes: what was sent still arrives, then the other side reads the end (keep it open until ``close``)."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        """Closes the connection, letting what was sent reach the other side first."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def accept(sock: socket.socket, token: str, peer: str, seconds: float = HANDSHAKE_SECONDS) -> tuple[Channel, dict]:
    """Master side of the handshake on a freshly accepted socket: (channel, the node's hello).

    The other side has ``seconds`` in all to send its hello.

    Raises:
        Refused: the other side does not know the token (it has been told so).
        WireError: it does not speak this protocol (told so when it got as far as a hello), or went silent.
    """
    deadline = time.monotonic() + seconds
    sock.settimeout(seconds)
    nonce = secrets.token_hex(16)
    try:
        _send_json(sock, {"protocol": PROTOCOL, "nonce": nonce})
    except OSError as err:
        raise WireError(f"connection lost ({err.strerror or err})") from None
    hello = _recv_json(sock, deadline)
    body, their_nonce, mac = hello.get("hello"), hello.get("nonce"), hello.get("mac")
    if not (isinstance(body, dict) and isinstance(their_nonce, str) and _NONCE.fullmatch(their_nonce)
            and isinstance(mac, str) and _HEX_MAC.fullmatch(mac)):
        _answer(sock, {"refused": "not a tfdist hello (protocol " + PROTOCOL + ")"})
        raise WireError("the first message was not a tfdist hello")
    secret = token.encode()
    signed = json.dumps(body, sort_keys=True).encode()
    expected = _mac(secret, b"hello", nonce.encode(), their_nonce.encode(), signed).hex()
    if not hmac.compare_digest(mac, expected):
        _answer(sock, {"refused": "wrong token: this node's token differs from node 0's"})
        raise Refused("wrong token")
    proof = _mac(secret, b"welcome", nonce.encode(), their_nonce.encode()).hex()
    _answer(sock, {"welcome": proof})
    key = _mac(secret, b"key", nonce.encode(), their_nonce.encode())
    sock.settimeout(None)
    return Channel(sock, key, "master", "node", peer), body


def _answer(sock: socket.socket, message: dict) -> None:
    """Sends a handshake answer; a peer gone meanwhile is found out by the next read."""
    try:
        _send_json(sock, message)
    except OSError:
        pass


def connect(sock: socket.socket, token: str, hello: dict, master: str) -> Channel:
    """Node side of the handshake on a socket connected to the master.

    Raises:
        Refused: the master refused this node (wrong token), or it could not prove it
            knows the token.
        Foreign: whatever answered is not a tfdist master.
        WireError: the connection was lost or timed out (a master busy turning others away closes some).
    """
    sock.settimeout(HANDSHAKE_SECONDS)
    greeting = _recv_json(sock)
    if greeting.get("protocol") != PROTOCOL:
        raise Foreign(f"{master} answered, but not as a tfdist master (protocol {greeting.get('protocol')!r})")
    nonce, mine, secret = str(greeting.get("nonce", "")), secrets.token_hex(16), token.encode()
    signed = json.dumps(hello, sort_keys=True).encode()
    mac = _mac(secret, b"hello", nonce.encode(), mine.encode(), signed).hex()
    _send_json(sock, {"hello": hello, "nonce": mine, "mac": mac})
    answer = _recv_json(sock)
    if "refused" in answer:
        raise Refused(str(answer["refused"]))
    expected = _mac(secret, b"welcome", nonce.encode(), mine.encode()).hex()
    if not hmac.compare_digest(str(answer.get("welcome", "")), expected):
        raise Refused(f"{master} could not prove that it knows this job's token")
    sock.settimeout(None)
    return Channel(sock, _mac(secret, b"key", nonce.encode(), mine.encode()), "node", "master", master)
