"""The multi-node launchers' wire: the token never sent, every message signed and numbered (no processes)."""

import json
import socket
import threading
import time

import pytest

from tfdist.launch import wire


def handshake(master_token, node_token, hello=None):
    """(master side result, node side result): a Channel/hello or the exception raised."""
    left, right = socket.socketpair()
    results = {}

    def master():
        try:
            results["master"] = wire.accept(left, master_token, "peer")
        except wire.WireError as err:
            results["master"] = err

    thread = threading.Thread(target=master)
    thread.start()
    try:
        results["node"] = wire.connect(right, node_token, hello or {"node_rank": 1}, "the master")
    except wire.WireError as err:
        results["node"] = err
    thread.join(10)
    return results["master"], results["node"], (left, right)


def test_signed_messages_go_both_ways_and_the_token_never_crosses():
    sent = []
    original = wire._send_frame
    wire._send_frame = lambda sock, payload: (sent.append(payload), original(sock, payload))[1]
    try:
        (master, hello), node, _ = handshake("s3cret-token", "s3cret-token", {"node_rank": 1, "ports": [5]})
    finally:
        wire._send_frame = original
    assert hello == {"node_rank": 1, "ports": [5]}
    node.send({"type": "ping", "n": 1})
    assert master.recv(timeout=5) == {"type": "ping", "n": 1}
    master.send({"type": "end", "exit_code": 0})
    assert node.recv(timeout=5) == {"type": "end", "exit_code": 0}
    assert not any(b"s3cret-token" in payload for payload in sent)


def test_a_wrong_token_is_refused_on_both_sides():
    master, node, _ = handshake("right", "wrong")
    assert isinstance(master, wire.Refused) and str(master) == "wrong token"
    assert isinstance(node, wire.Refused) and str(node) == "wrong token: this node's token differs from node 0's"


def test_a_master_that_does_not_know_the_token_is_refused():
    left, right = socket.socketpair()
    wire._send_json(left, {"protocol": wire.PROTOCOL, "nonce": "00"})
    wire._send_json(left, {"welcome": "0" * 64})  # a fake master cannot compute the proof
    with pytest.raises(wire.Refused, match="the master could not prove that it knows this job's token"):
        wire.connect(right, "token", {"node_rank": 1}, "the master")


def test_a_replayed_or_altered_message_fails_its_signature_check():
    (master, _), node, (left, right) = handshake("t", "t")
    captured = []
    original = wire._send_frame
    wire._send_frame = lambda sock, payload: (captured.append(payload), original(sock, payload))[1]
    try:
        node.send({"type": "ping"})
    finally:
        wire._send_frame = original
    assert master.recv(timeout=5) == {"type": "ping"}
    wire._send_frame(right, captured[0])  # the same frame again: its number is stale
    with pytest.raises(wire.WireError, match="failed its signature check"):
        master.recv(timeout=5)
    (master, _), node, (left, right) = handshake("t", "t")
    frame = captured[0][:32] + json.dumps({"type": "stop"}).encode()
    wire._send_frame(right, frame)
    with pytest.raises(wire.WireError, match="failed its signature check"):
        master.recv(timeout=5)


def test_what_is_not_the_protocol_is_refused():
    left, right = socket.socketpair()
    right.sendall(b"GET / HTTP/1.1\r\n\r\n")
    with pytest.raises(wire.WireError, match="a frame of 1195725856 bytes is not this protocol"):
        wire.accept(left, "token", "peer")


@pytest.mark.parametrize("hello", [
    {"hello": {"node_rank": 1}, "nonce": "00", "mac": "\u00e9" * 64},  # not ASCII: hmac would raise TypeError
    {"hello": {"node_rank": 1}, "nonce": "\ud800", "mac": "0" * 64},  # a lone surrogate: not encodable
    {"hello": {"node_rank": 1}, "nonce": ["00"], "mac": 5},
    {"hello": [], "nonce": "00", "mac": "0" * 64},
])
def test_a_malformed_hello_is_refused_with_an_answer(hello):
    left, right = socket.socketpair()
    wire._send_json(right, hello)
    with pytest.raises(wire.WireError, match="the first message was not a tfdist hello"):
        wire.accept(left, "token", "peer")
    assert wire._recv_json(right)["protocol"] == wire.PROTOCOL  # the greeting
    assert wire._recv_json(right) == {"refused": "not a tfdist hello (protocol tfdist-nodes/1)"}


def test_a_trickling_peer_gets_one_deadline_for_the_whole_handshake():
    left, right = socket.socketpair()

    def trickle():  # a 16-byte frame, one byte every 0.3 s: each read is quick, the whole is not
        for byte in b"\0\0\0\x10" + b"x" * 16:
            try:
                right.send(bytes([byte]))
            except OSError:
                return
            time.sleep(0.3)

    threading.Thread(target=trickle, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(wire.WireError, match="timed out waiting for the other side"):
        wire.accept(left, "token", "peer", seconds=1)
    assert time.monotonic() - started < 3
    left.close()
