"""``mlxspec serve``: an OpenAI-compatible HTTP server over the continuous-batching ``Engine``.

Threads: the standard library's ``ThreadingHTTPServer`` (as ``mlx_lm.server``) runs one thread per
connection; one engine thread owns the model and the ``Engine`` and is the only one that touches
MLX. A connection hands its parsed request to the engine thread as a ``Ticket`` and reads the
events back from the ticket's queue. While it waits it watches its socket: a client that goes
away cancels its ticket, and the engine drops the stream before the next decode step.

Routes (as mlx-lm's server): ``POST /v1/chat/completions`` (also ``/chat/completions``),
``POST /v1/completions``, ``GET /v1/models``, ``GET /health``.

Safety: binds 127.0.0.1 unless told otherwise; optional bearer API key; limits on the body size,
``max_tokens``, the context and the number of open requests (429 beyond it); malformed requests
get 400 with a JSON error. ``Server.drain()`` (SIGTERM / Ctrl-C in ``serve``) refuses new
requests (503), lets the open ones finish, then stops.
"""

from __future__ import annotations

import hmac
import json
import logging
import queue
import select
import signal
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from mlxspec.serving.batch import chat_template_prefix
from mlxspec.serving.engine import Engine, Event
from mlxspec.serving.engine_thread import POLL_SECONDS, EngineThread, Ticket
from mlxspec.serving.openai_api import (
    ApiError,
    Completion,
    Limits,
    chunk_body,
    models_body,
    parse_completion,
    response_body,
    usage_chunk,
)

log = logging.getLogger("mlxspec.serving.http")


LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


class Server:
    """The HTTP server and its engine thread.

    Args:
        engine: the ``Engine`` (it belongs to the server's engine thread from ``start()`` on).
        model_id: the name ``/v1/models`` reports.
        host, port: where to listen (port 0: any free port; see ``url``).
        api_key: if set, requests need ``Authorization: Bearer <api_key>``.
        limits: request limits.
        allowed_origins: web origins whose pages may call the server (CORS; ``"*"``: any).
            None by default: a page the user visits cannot use a local model behind their back.

    The engine's shared prefix becomes the start every chat prompt has (``chat_template_prefix``):
    prefilled once, so no request prefills it again, not even the first ones of a burst.
    """

    def __init__(self, engine: Engine, *, model_id: str, host: str = "127.0.0.1",
                 port: int = 8080, api_key: str | None = None, limits: Limits | None = None,
                 allowed_origins: tuple[str, ...] = ()):
        engine.share_prefix(chat_template_prefix(engine.tokenizer))
        self.engine_thread = EngineThread(engine)
        self.tokenizer = engine.tokenizer
        self.model_id = model_id
        self.api_key = api_key
        self.allowed_origins = tuple(allowed_origins)
        self.limits = limits or Limits()
        self.created = int(time.time())
        self.draining = False
        self._open = 0
        self._lock = threading.Lock()
        self.httpd = _HTTPServer((host, port), _handler_class(self))
        self._http_thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> Server:
        """Serve in background threads (returns at once)."""
        self.engine_thread.start()
        self._http_thread = threading.Thread(target=self.httpd.serve_forever,
                                             name="mlxspec-http", daemon=True)
        self._http_thread.start()
        return self

    def drain(self, timeout: float = 30.0) -> None:
        """Refuse new requests, wait up to ``timeout`` s for the open ones, then stop."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.open_requests and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
        self.close()

    def close(self) -> None:
        self.draining = True
        self.httpd.shutdown()
        self.httpd.server_close()
        self.engine_thread.stop()
        self.engine_thread.join(timeout=10)

    @property
    def open_requests(self) -> int:
        return self._open

    def acquire(self) -> bool:
        """Count one more open request, unless at the limit."""
        with self._lock:
            if self._open >= self.limits.max_concurrent:
                return False
            self._open += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._open -= 1

    def health(self) -> dict[str, Any]:
        engine = self.engine_thread.engine
        ok = self.engine_thread.is_alive() and not self.draining
        return {"status": "ok" if ok else "unavailable", "open_requests": self._open,
                "active_streams": len(engine.streams), "speculating": engine.speculating}


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # a burst of connections waits in the backlog instead of failing


def _handler_class(server: Server) -> type[BaseHTTPRequestHandler]:
    class Handler(_Handler):
        owner = server

    return Handler


class _Handler(BaseHTTPRequestHandler):
    owner: Server
    server_version = "mlxspec"
    timeout = 60  # seconds a silent client may hold a connection while sending its request

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s - " + format, self.address_string(), *args)

    # -- plumbing ----------------------------------------------------------------------------

    def _cors(self) -> None:
        allowed, origin = self.owner.allowed_origins, self.headers.get("Origin")
        if origin is None or not allowed:
            return
        if "*" in allowed or origin in allowed:
            self.send_header("Access-Control-Allow-Origin", "*" if "*" in allowed else origin)
            self.send_header("Vary", "Origin")
            self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
            self.send_header("Access-Control-Allow-Headers", "Authorization, Content-Type")

    def _send_json(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self._cors()
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, error: ApiError) -> None:
        headers = {"Retry-After": "1"} if error.status in (429, 503) else None
        self._send_json(error.status, error.body(), headers)

    def _authorized(self) -> bool:
        key = self.owner.api_key
        if key is None:
            return True
        given = self.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {key}".encode())

    def _host_allowed(self) -> bool:
        """On a loopback address, only loopback names in Host (DNS rebinding); any Host when the
        user chose another address with --host."""
        bound = self.owner.httpd.server_address[0]
        if bound not in LOOPBACK_HOSTS:
            return True
        host = self.headers.get("Host", "")
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        return name.strip("[]").lower() in LOOPBACK_HOSTS

    def _client_gone(self) -> bool:
        """Whether the client closed its side (a readable socket with nothing to read)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    # -- routes ------------------------------------------------------------------------------

    def do_OPTIONS(self) -> None:  # a browser's CORS preflight
        self.send_response(204)
        self._cors()
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        path = self.path.split("?")[0].rstrip("/")
        if path == "/health":
            body = self.owner.health()
            self._send_json(200 if body["status"] == "ok" else 503, body)
        elif not self._authorized():
            self._send_error(ApiError("invalid API key", 401, kind="authentication_error"))
        elif path == "/v1/models":
            self._send_json(200, models_body(self.owner.model_id, self.owner.created))
        else:
            self._send_error(ApiError(f"no route {self.path}", 404, kind="not_found_error"))

    def do_POST(self) -> None:
        kinds = {"/v1/chat/completions": "chat", "/chat/completions": "chat",
                 "/v1/completions": "text"}
        kind = kinds.get(self.path.split("?")[0].rstrip("/"))
        if kind is None:
            self._send_error(ApiError(f"no route {self.path}", 404, kind="not_found_error"))
            return
        if not self._authorized():
            self._send_error(ApiError("invalid API key", 401, kind="authentication_error"))
            return
        # A web page can send a "simple" cross-site POST (text/plain, no preflight) to a server on
        # loopback, and with DNS rebinding a foreign Host: both are refused.
        if self.headers.get("Content-Type", "").split(";")[0].strip().lower() != "application/json":
            self._send_error(ApiError("send the body as Content-Type: application/json", 415,
                                      kind="invalid_request_error"))
            return
        if not self._host_allowed():
            self._send_error(ApiError("unexpected Host header for a loopback server", 403,
                                      kind="permission_error"))
            return
        if self.owner.draining:
            self._send_error(ApiError("the server is shutting down", 503, kind="server_error"))
            return
        try:
            completion = self._parse(kind)
        except ApiError as e:
            self.close_connection = True  # the body may be unread
            self._send_error(e)
            return
        if not self.owner.acquire():
            self._send_error(ApiError("too many open requests: retry later", 429,
                                      kind="rate_limit_error"))
            return
        try:
            self._complete(completion)
        finally:
            self.owner.release()

    def _parse(self, kind: str) -> Completion:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise ApiError("a Content-Length header is required", 411)
        limit = self.owner.limits.max_body_bytes
        if int(length) > limit:
            if int(length) <= 4 * limit:  # read it away, so the client can read our answer
                self.rfile.read(int(length))
            raise ApiError(f"the body is over {limit} bytes", 413)
        raw = self.rfile.read(int(length))
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(f"the body is not valid JSON: {e}") from e
        return parse_completion(body, kind, self.owner.tokenizer, self.owner.limits,
                                self.owner.model_id)

    def _events(self, ticket: Ticket):
        """Events of the ticket as they come; cancels it if the client goes away."""
        checked = time.monotonic()
        while True:
            if time.monotonic() - checked >= POLL_SECONDS:  # also while tokens keep coming
                checked = time.monotonic()
                if self._client_gone():
                    ticket.cancelled = True
                    return
            try:
                item = ticket.events.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if not self.owner.engine_thread.is_alive():
                    raise ApiError("the generation thread has stopped", 500,
                                   kind="server_error") from None
                if self._client_gone():
                    ticket.cancelled = True
                    return
                continue
            if isinstance(item, ApiError):
                raise item
            batch = [item]
            while item.finish_reason is None:  # take what else is ready: fewer, larger writes
                try:
                    item = ticket.events.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, ApiError):
                    raise item
                batch.append(item)
            yield batch
            if item.finish_reason is not None:
                return

    def _complete(self, completion: Completion) -> None:
        ticket = Ticket(completion)
        self.owner.engine_thread.submit(ticket)
        events: list[Event] = []
        tic = time.perf_counter()
        try:
            self._answer(completion, ticket, events)
        finally:
            last = events[-1] if events else None
            outcome = "disconnected" if ticket.cancelled else "failed"
            if last is not None and last.finish_reason is not None:
                outcome = f"finish={last.finish_reason}"
            log.info("%s %s %s prompt=%s cached=%s completion=%s %.2fs", self.path,
                     "stream" if completion.stream else "json", outcome,
                     last and last.prompt_tokens, last and last.cached_tokens,
                     last and last.completion_tokens, time.perf_counter() - tic)

    def _answer(self, completion: Completion, ticket: Ticket, events: list[Event]) -> None:
        """Write the response; ``events`` is filled with what was sent (the last one last)."""
        tokenizer = self.owner.tokenizer
        try:
            if not completion.stream:
                for batch in self._events(ticket):
                    events.extend(batch)
                if events and events[-1].finish_reason is not None:
                    self._send_json(200, response_body(completion, events, tokenizer))
                return
            first = True
            for batch in self._events(ticket):
                if first:
                    self.send_response(200)
                    self._cors()
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Cache-Control", "no-cache")
                    self.end_headers()
                events.extend(batch)
                if first or batch[-1].finish_reason or completion.request.logprobs or any(
                    e.text for e in batch
                ):
                    self._sse(chunk_body(completion, batch, tokenizer, first=first))
                    first = False
            if events and events[-1].finish_reason is not None:
                if completion.include_usage:
                    self._sse(usage_chunk(completion, events[-1]))
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
        except ApiError as e:
            if not completion.stream or not events:
                self._send_error(e)
            else:
                self._sse(e.body())
        except (BrokenPipeError, ConnectionResetError, TimeoutError, OSError):
            ticket.cancelled = True  # the client went away mid-write: free its slot
            self.close_connection = True

    def _sse(self, body: dict) -> None:
        self.wfile.write(f"data: {json.dumps(body)}\n\n".encode())
        self.wfile.flush()


def serve_forever(server: Server, drain_timeout: float = 30.0) -> None:
    """Run until SIGTERM or Ctrl-C, then drain (finish open requests) and stop."""
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.start()
        while not stop.wait(0.5):
            if not server.engine_thread.is_alive():
                break
    finally:
        server.drain(drain_timeout)
        for s, handler in old.items():
            signal.signal(s, handler)
