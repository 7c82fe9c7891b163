"""The one way a part answers an HTTP request itself: a JSON body.

Used where the shim speaks for the server: /health from the heartbeat part,
the 503s of the exit part. Headers as stock sends them (JSON type, the
server's CORS headers) plus what a client needs to act on a 503.
"""

import json


def send_json(handler, status, body, *, close=False, retry_after=5):
    """Write a complete JSON response on handler (a BaseHTTPRequestHandler);
    a 503 says when to retry (retry_after, whole seconds)."""
    data = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    cors = getattr(handler, "_set_cors_headers", None)
    if cors is not None:
        try:
            cors()
        except Exception:  # noqa: BLE001 - CORS settings may be missing (a handler not yet set up)
            pass
    handler.send_header("Content-Length", str(len(data)))
    if status == 503:
        handler.send_header("Retry-After", str(int(retry_after)))
    if close:
        handler.send_header("Connection", "close")
    handler.end_headers()
    handler.wfile.write(data)
    handler.wfile.flush()
