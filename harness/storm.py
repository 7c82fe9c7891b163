"""A burst of clients that arrive at the same moment, for tests and the bench.

Threads that each open a connection and send would arrive spread over the
time it takes to start them (tens of milliseconds on a loaded machine, which
is a good part of one tiny-model service time). Here every connection is
opened first, then every request is written in one tight loop, and only then
do the readers start: the server sees the whole burst at once.

Each answer is read to its end (the server closes the connection: every
request says ``Connection: close``) and parsed; ``at_end`` runs in the
reader's thread as soon as the answer is complete (a test reads the server's
decode-step count there).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from harness.procs import chat_body


@dataclass
class Answer:
    index: int
    sent_at: float
    status: Optional[int] = None
    headers: Dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    finished_at: Optional[float] = None
    at_end: object = None  # what at_end() returned
    error: Optional[str] = None

    @property
    def latency_s(self) -> Optional[float]:
        return None if self.finished_at is None else self.finished_at - self.sent_at

    def json(self):
        return json.loads(self.body)


def request_bytes(port: int, body: dict, headers: Optional[Dict[str, str]] = None) -> bytes:
    data = json.dumps(body).encode()
    lines = ["POST /v1/chat/completions HTTP/1.1", f"Host: 127.0.0.1:{port}",
             "Content-Type: application/json", f"Content-Length: {len(data)}",
             "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


def _parse(raw: bytes, answer: Answer) -> None:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    answer.status = int(lines[0].split()[1])
    for line in lines[1:]:
        name, _, value = line.partition(":")
        answer.headers[name.strip().lower()] = value.strip()
    answer.body = body


def burst(port: int, count: int, *, max_tokens: int, timeout: float = 600,
          at_end: Optional[Callable[[], object]] = None, clock=time.monotonic,
          headers: Optional[Dict[str, str]] = None) -> List[Answer]:
    """count chat completions of max_tokens each, all at once; their answers."""
    sockets = [socket.create_connection(("127.0.0.1", port), timeout=timeout)
               for _ in range(count)]
    payloads = [request_bytes(port, chat_body(f"story {i}", max_tokens=max_tokens), headers)
                for i in range(count)]
    answers = []
    for i, (sock, payload) in enumerate(zip(sockets, payloads)):
        answers.append(Answer(index=i, sent_at=clock()))
        sock.sendall(payload)

    def read(sock: socket.socket, answer: Answer) -> None:
        chunks = []
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
            answer.finished_at = clock()
            if at_end is not None:
                answer.at_end = at_end()
            _parse(b"".join(chunks), answer)
        except (OSError, ValueError, IndexError) as exc:
            answer.error = repr(exc)
        finally:
            sock.close()

    readers = [threading.Thread(target=read, args=(s, a), daemon=True)
               for s, a in zip(sockets, answers)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(timeout)
    return answers
