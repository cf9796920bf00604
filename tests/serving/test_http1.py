"""The router's HTTP/1.1 framer: request and response heads, chunked bodies. No I/O."""

from __future__ import annotations

import pytest

from serving.errors import ProtocolError
from serving.wire.http1 import ChunkedScanner, parse_request_head, parse_response_head


def req(*lines: str) -> bytes:
    return "\r\n".join(lines).encode()


def test_request_head_is_reframed_without_hop_by_hop_fields():
    r = parse_request_head(
        req(
            "POST /v1/completions?x=1 HTTP/1.1",
            "Host: router:8080",
            "Content-Type: application/json",
            "Content-Length: 12",
            "Connection: keep-alive, X-Hop",
            "X-Hop: secret",
            "Keep-Alive: timeout=5",
            "TE: trailers",
            "Authorization: Bearer k",
        )
    )
    assert (r.method, r.target, r.path, r.http11) == (
        b"POST",
        b"/v1/completions?x=1",
        b"/v1/completions",
        True,
    )
    assert r.length == 12 and not r.chunked and r.keep_alive and not r.expect_continue
    assert r.fields == b"Content-Type: application/json\r\nAuthorization: Bearer k\r\n"


def test_request_persistence_and_expect():
    assert not parse_request_head(req("GET / HTTP/1.1", "Connection: close")).keep_alive
    assert not parse_request_head(req("GET / HTTP/1.0")).keep_alive
    assert parse_request_head(req("GET / HTTP/1.0", "Connection: Keep-Alive")).keep_alive
    r = parse_request_head(req("POST / HTTP/1.1", "Expect: 100-continue", "Content-Length: 5"))
    assert r.expect_continue and r.fields == b""
    with pytest.raises(ProtocolError) as e:
        parse_request_head(req("POST / HTTP/1.1", "Expect: something-else"))
    assert e.value.status == 417


def test_request_chunked_and_lengths():
    r = parse_request_head(req("POST / HTTP/1.1", "Transfer-Encoding: chunked"))
    assert r.chunked and r.length is None
    assert parse_request_head(req("POST / HTTP/1.1", "Content-Length: 7, 7")).length == 7
    assert parse_request_head(req("GET / HTTP/1.1")).length is None


@pytest.mark.parametrize(
    "head,status",
    [
        # request smuggling shapes: the router and a backend could frame these differently
        (req("POST / HTTP/1.1", "Content-Length: 5", "Transfer-Encoding: chunked"), 400),
        (req("POST / HTTP/1.1", "Content-Length: 5", "Content-Length: 6"), 400),
        (req("POST / HTTP/1.1", "Content-Length: 5, 6"), 400),
        (req("POST / HTTP/1.1", "Content-Length: -5"), 400),
        (req("POST / HTTP/1.1", "Content-Length: 0x5"), 400),
        (req("POST / HTTP/1.1", "Content-Length : 5"), 400),
        (req("POST / HTTP/1.1", "Transfer-Encoding: gzip, chunked"), 501),
        (req("POST / HTTP/1.1", "Transfer-Encoding: chunked", "Transfer-Encoding: x"), 501),
        (req("POST / HTTP/1.0", "Transfer-Encoding: chunked"), 501),
        (req("GET / HTTP/1.1", "X-A: 1", " folded"), 400),
        (b"GET / HTTP/1.1\r\nX-A: a\nContent-Length: 5", 400),
        (b"GET / HTTP/1.1\r\nX-A: a\rb", 400),
        (b"GET / HTTP/1.1\r\nX-A: a\x00b", 400),
        (req("GET / HTTP/1.1", ": empty name"), 400),
        (req("GET / HTTP/1.1", "no colon"), 400),
        (req("GET /  HTTP/1.1"), 400),
        (req("GET http://h/ HTTP/1.1"), 400),
        (req("GET / HTTP/2.0"), 505),
        (req("G(T / HTTP/1.1"), 400),
        (req(""), 400),
    ],
)
def test_malformed_requests_are_refused(head, status):
    with pytest.raises(ProtocolError) as e:
        parse_request_head(head)
    assert e.value.status == status


def test_response_framing():
    r = parse_response_head(req("HTTP/1.1 200 OK", "Content-Length: 10", "X-Backend: b0"))
    assert (r.status, r.length, r.chunked, r.until_close, r.reusable) == (
        200,
        10,
        False,
        False,
        True,
    )
    assert r.out == b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\nX-Backend: b0\r\n\r\n"
    assert not r.rewritten
    r = parse_response_head(req("HTTP/1.1 200 OK", "Transfer-Encoding: chunked"))
    assert r.chunked and r.length is None and r.reusable
    r = parse_response_head(req("HTTP/1.1 200 OK", "Content-Type: text/plain"))
    assert r.until_close and not r.reusable
    r = parse_response_head(req("HTTP/1.1 200 OK", "Content-Length: 10"), head_request=True)
    assert r.length == 0 and r.reusable
    for code in (204, 304, 100):
        assert parse_response_head(req(f"HTTP/1.1 {code} X")).length == 0
    assert parse_response_head(b"HTTP/1.1 200").status == 200  # no reason phrase


def test_response_connection_fields_are_the_routers_business():
    r = parse_response_head(
        req("HTTP/1.1 200 OK", "Connection: close, X-Hop", "X-Hop: 1", "Content-Length: 2")
    )
    assert not r.reusable and r.rewritten
    assert r.out == b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n"
    r = parse_response_head(req("HTTP/1.0 200 OK", "Content-Length: 2"))
    assert not r.reusable
    r = parse_response_head(req("HTTP/1.0 200 OK", "Connection: keep-alive", "Content-Length: 2"))
    assert r.reusable and r.out == b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n"


@pytest.mark.parametrize(
    "head",
    [
        req("HTTP/1.1 200 OK", "Content-Length: 1", "Content-Length: 2"),
        req("HTTP/1.1 200 OK", "Content-Length: x"),
        req("HTTP/1.1 2000 OK"),
        req("HTTP/2 200 OK"),
        req("HTTP/1.1 200 OK", "Bad Line"),
        b"HTTP/1.1 200 OK\r\nX: a\nContent-Length: 0",
    ],
)
def test_malformed_responses_are_502(head):
    with pytest.raises(ProtocolError) as e:
        parse_response_head(head)
    assert e.value.status == 502


BODY = b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"


def test_chunked_scanner_whole_and_bytewise():
    s = ChunkedScanner(collect=True)
    assert s.feed(BODY + b"NEXT") == len(BODY) and s.done
    assert bytes(s.body) == b"hello world"
    s = ChunkedScanner(collect=True)
    ends = [s.feed(BODY[i : i + 1]) for i in range(len(BODY))]
    assert ends[:-1] == [-1] * (len(BODY) - 1) and ends[-1] == 1
    assert bytes(s.body) == b"hello world"
    s = ChunkedScanner()  # pass-through: finds the end, keeps nothing
    assert s.feed(b"xx" + BODY, 2) == len(BODY) + 2 and s.body is None
    assert ChunkedScanner().feed(b"0\r\n\r\n") == 5


@pytest.mark.parametrize(
    "body",
    [
        b"x\r\nhello\r\n0\r\n\r\n",  # not hex
        b"+5\r\nhello\r\n0\r\n\r\n",
        b"5\nhello\r\n0\r\n\r\n",  # bare LF
        b"5\r\nhelloX\r\n0\r\n\r\n",  # data longer than the size says
        b"1" * 5000,  # endless size line
    ],
)
def test_chunked_scanner_refuses_bad_framing(body):
    with pytest.raises(ProtocolError):
        ChunkedScanner(status=502).feed(body)


def test_chunked_scanner_limit_and_done():
    with pytest.raises(ProtocolError) as e:
        ChunkedScanner(collect=True, limit=4).feed(b"5\r\nhello\r\n0\r\n\r\n")
    assert e.value.status == 413
    s = ChunkedScanner()
    s.feed(b"0\r\n\r\n")
    with pytest.raises(ProtocolError):
        s.feed(b"1")
