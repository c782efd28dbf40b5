"""A fault-injecting HTTP proxy in front of an S3-compatible server, for testing how reads survive a
misbehaving store.

Requests pass through unchanged (the Host header too, so SigV4 signatures still match) unless a
fault rule picks them. A rule injects one kind of fault into the requests it matches, either a
``fraction`` of them or the ``count`` next ones, optionally only while ``seconds`` have not passed
and only for paths containing ``path``:

- ``slowdown``: a 503 with S3's ``SlowDown`` XML error body;
- ``reset``: the connection is reset (TCP RST) once the request has been read;
- ``stall``: the request waits ``stall_s`` seconds, then goes through;
- ``refuse``: every connection is reset as soon as it is accepted (an outage; a store that is
  down answers nothing);
- ``hang``: the request is held unanswered until the rule ends, then the connection is reset
  (an outage where packets vanish).

Rules change at run time, from the same process (:meth:`FaultProxy.inject`) or from another one
through the control path ``/_faults`` (no S3 bucket name may contain an underscore):
``POST /_faults`` with a rule as JSON adds it, ``DELETE /_faults`` removes every rule, and
``GET /_faults`` returns the counts of requests seen and faults injected.

Command line::

    python -m tests.support.fault_proxy serve --upstream http://127.0.0.1:9000 [--port 9100]
    python -m tests.support.fault_proxy inject --proxy http://127.0.0.1:9100 slowdown --fraction 0.1
    python -m tests.support.fault_proxy inject --proxy http://127.0.0.1:9100 hang --seconds 30
    python -m tests.support.fault_proxy clear --proxy http://127.0.0.1:9100
    python -m tests.support.fault_proxy stats --proxy http://127.0.0.1:9100
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import socket
import struct
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Sequence
from urllib.parse import urlparse

KINDS = ("slowdown", "reset", "stall", "refuse", "hang")
CONTROL_PATH = "/_faults"
SLOWDOWN_BODY = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    "<Message>Please reduce your request rate.</Message><RequestId>{request}</RequestId></Error>"
)
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}


@dataclass(eq=False)  # rules are compared by identity: two alike rules are still two
class FaultRule:
    """One kind of fault for the requests it matches: a ``fraction`` of them, or the ``count``
    next ones (``count`` wins when both are set); until ``seconds`` have passed since the first
    request it matched, if set (counted from that request, not from the rule's start, so that an
    outage meant for a client's reads meets them however long the client takes to start)."""

    kind: str
    fraction: float = 1.0
    count: int | None = None
    seconds: float | None = None
    stall_s: float = 5.0
    path: str = ""
    started: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault {self.kind!r}: choose one of {', '.join(KINDS)}")
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"fraction {self.fraction} is not between 0 and 1")

    @property
    def expired(self) -> bool:
        remaining = self.remaining_s()
        return remaining == 0.0 or self.count == 0

    def remaining_s(self) -> float | None:
        if self.seconds is None:
            return None
        if self.started is None:
            return self.seconds
        return max(0.0, self.seconds - (time.monotonic() - self.started))


class FaultState:
    """The active rules and the counts, shared by every connection thread."""

    def __init__(self, seed: int = 0) -> None:
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.rules: list[FaultRule] = []
        self.random = random.Random(seed)
        self.requests = 0
        self.injected: Counter[str] = Counter()

    def add(self, rule: FaultRule) -> None:
        with self.lock:
            self.rules.append(rule)
            self.changed.notify_all()

    def clear(self) -> None:
        with self.lock:
            self.rules.clear()
            self.changed.notify_all()

    def pick(self, path: str, *, on_connect: bool = False) -> FaultRule | None:
        """The rule that applies to this request (counted), or None. ``refuse`` applies to
        connections, the others to requests."""
        with self.lock:
            self.rules = [rule for rule in self.rules if not rule.expired]
            if not on_connect:
                self.requests += 1
            for rule in self.rules:
                if (rule.kind == "refuse") != on_connect or rule.path not in path:
                    continue
                if rule.started is None:
                    rule.started = time.monotonic()
                if rule.count is None and self.random.random() >= rule.fraction:
                    continue
                if rule.count is not None:
                    rule.count -= 1
                self.injected[rule.kind] += 1
                return rule
        return None

    def hold(self, rule: FaultRule, stop: threading.Event) -> None:
        """Wait until ``rule`` ends (expired or cleared) or the proxy stops."""
        with self.lock:
            while rule in self.rules and not rule.expired and not stop.is_set():
                remaining = rule.remaining_s()
                self.changed.wait(timeout=min(remaining, 0.5) if remaining is not None else 0.5)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                "requests": self.requests,
                "injected": dict(self.injected),
                "rules": [
                    {key: value for key, value in asdict(rule).items() if key != "started"} | {"remaining_s": rule.remaining_s()}
                    for rule in self.rules
                    if not rule.expired
                ],
            }


def reset_connection(sock: socket.socket) -> None:
    """Close with a TCP RST (SO_LINGER 0) instead of an orderly FIN: what a crashed peer or a
    middlebox dropping state looks like to the client."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients expect
    server: _ProxyServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def setup(self) -> None:
        super().setup()
        self.upstream: http.client.HTTPConnection | None = None

    def finish(self) -> None:
        if self.upstream is not None:
            self.upstream.close()
        try:
            super().finish()
        except OSError:
            pass

    def _body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is not None:
            return self.rfile.read(int(length))
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size_line = self.rfile.readline()
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                chunk = self.rfile.read(size)
                self.rfile.readline()  # the CRLF after the chunk
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(chunk)
        return b""

    def _relay(self) -> None:
        state = self.server.state
        if self.path.startswith(CONTROL_PATH):
            return self._control()
        body = self._body()
        if state.pick(self.path, on_connect=True) is not None:  # an outage also breaks open connections
            self.close_connection = True
            return reset_connection(self.connection)
        rule = state.pick(self.path)
        if rule is not None:
            if rule.kind == "slowdown":
                return self._reply(503, SLOWDOWN_BODY.format(request=state.requests).encode(), "application/xml")
            if rule.kind == "reset":
                self.close_connection = True
                return reset_connection(self.connection)
            if rule.kind == "hang":
                state.hold(rule, self.server.stopping)
                self.close_connection = True
                return reset_connection(self.connection)
            if rule.kind == "stall":
                self.server.stopping.wait(rule.stall_s)
        try:
            status, reason, headers, payload = self._forward(body)
        except (OSError, http.client.HTTPException) as error:  # upstream down: a gateway error, as a load balancer would answer
            return self._reply(502, f"upstream {self.server.upstream_address}: {error}".encode(), "text/plain")
        self.send_response(status, reason)
        for name, value in headers:
            if name.lower() not in HOP_BY_HOP and (name.lower() != "content-length" or self.command == "HEAD"):
                self.send_header(name, value)  # a HEAD answer keeps the object's length
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _relay

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        """Send the request upstream as it came (Host included) and read the whole answer; a
        kept-alive upstream connection that went stale is reopened once."""
        for attempt in range(2):
            if self.upstream is None:
                host, port = self.server.upstream_address
                self.upstream = http.client.HTTPConnection(host, port, timeout=300)
            try:
                self.upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in HOP_BY_HOP and name.lower() != "content-length":
                        self.upstream.putheader(name, value)
                if body or self.command in ("PUT", "POST"):
                    self.upstream.putheader("Content-Length", str(len(body)))
                self.upstream.endheaders(body or None)
                response = self.upstream.getresponse()
                payload = response.read()
                return response.status, response.reason, response.getheaders(), payload
            except (OSError, http.client.HTTPException) as error:
                self.upstream.close()  # never reused half-way through an exchange
                self.upstream = None
                stale = isinstance(error, (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError))
                if attempt == 1 or not stale:
                    raise
        raise AssertionError("unreachable")

    def _reply(self, status: int, payload: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def _control(self) -> None:
        state = self.server.state
        try:
            if self.command == "POST":
                state.add(FaultRule(**json.loads(self._body() or b"{}")))
            elif self.command == "DELETE":
                state.clear()
        except (TypeError, ValueError) as error:
            return self._reply(400, json.dumps({"error": str(error)}).encode(), "application/json")
        self._reply(200, json.dumps(state.snapshot()).encode(), "application/json")


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], upstream: str, state: FaultState):
        super().__init__(address, _Handler)
        parsed = urlparse(upstream)
        self.upstream_address = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self.state = state
        self.stopping = threading.Event()

    def verify_request(self, request: Any, client_address: Any) -> bool:
        if self.state.pick("", on_connect=True) is not None:
            reset_connection(request)
            return False
        return True


class FaultProxy:
    """The proxy, serving from a background thread: ``endpoint`` is what clients use instead of
    the upstream server's address."""

    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 0, seed: int = 0):
        self.state = FaultState(seed)
        self.server = _ProxyServer((host, port), upstream, self.state)
        self.upstream = upstream
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FaultProxy:
        self._thread = threading.Thread(target=self.server.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.stopping.set()
        self.state.clear()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def inject(self, kind: str, **options: Any) -> FaultRule:
        """Start injecting ``kind`` (see :class:`FaultRule` for the options); returns the rule."""
        rule = FaultRule(kind, **options)
        self.state.add(rule)
        return rule

    def clear(self) -> None:
        """Stop every fault: later requests pass through, held ones are released."""
        self.state.clear()

    def stats(self) -> dict[str, Any]:
        """Requests seen, faults injected by kind, and the rules still active."""
        return self.state.snapshot()


def control(proxy: str, method: str, rule: dict[str, Any] | None = None) -> dict[str, Any]:
    """Talk to a proxy's control path from another process."""
    data = json.dumps(rule).encode() if rule is not None else None
    request = urllib.request.Request(
        proxy.rstrip("/") + CONTROL_PATH, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.fault_proxy", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the proxy in the foreground")
    serve.add_argument("--upstream", required=True, help="the S3 server, e.g. http://127.0.0.1:9000")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    serve.add_argument("--seed", type=int, default=0, help="seed of the choice of requests for --fraction")
    inject = commands.add_parser("inject", help="add a fault rule to a running proxy")
    inject.add_argument("kind", choices=KINDS)
    inject.add_argument("--fraction", type=float, default=1.0, help="share of matching requests (default all)")
    inject.add_argument("--count", type=int, help="only the next N matching requests")
    inject.add_argument("--seconds", type=float, help="only for this long")
    inject.add_argument("--stall-s", type=float, default=5.0, help="stall: seconds each request waits")
    inject.add_argument("--path", default="", help="only requests whose path contains this")
    for name, text in (("clear", "remove every fault rule"), ("stats", "print requests seen and faults injected")):
        commands.add_parser(name, help=text)
    for name in ("inject", "clear", "stats"):
        commands.choices[name].add_argument("--proxy", required=True, help="the proxy's endpoint")
    args = parser.parse_args(argv)
    if args.command == "serve":
        proxy = FaultProxy(args.upstream, args.host, args.port, args.seed)
        print(f"fault proxy on {proxy.endpoint} -> {args.upstream}; control at {proxy.endpoint}{CONTROL_PATH}", flush=True)
        try:
            proxy.server.serve_forever()
        except KeyboardInterrupt:
            pass
        return 0
    if args.command == "inject":
        rule = {
            "kind": args.kind,
            "fraction": args.fraction,
            "count": args.count,
            "seconds": args.seconds,
            "stall_s": args.stall_s,
            "path": args.path,
        }
        result = control(args.proxy, "POST", rule)
    else:
        result = control(args.proxy, "DELETE" if args.command == "clear" else "GET")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
