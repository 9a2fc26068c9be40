#!/usr/bin/env python3
"""A demo backend for trying tollgate: answers every method with 200 and a short JSON echo.

`python3 -m http.server` answers POST, PUT, DELETE and PATCH with 501, which hides what the
proxy does. This one (standard library only) reads the request body, whatever the method, and
answers 200 with what it received:

    python3 examples/demo_backend.py                 # 127.0.0.1:9000, as proxy.toml.example
    python3 examples/demo_backend.py --bind 0.0.0.0 --port 9000   # in a container

With --port 0 it picks a free port; the first line on stdout is always
"listening on HOST:PORT". Not for production: it echoes request details back to the caller.
"""

import argparse
import json
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# Bodies are read to keep the connection usable, but only this much is kept for the echo;
# the rest is read and dropped, so a large upload cannot grow the process.
MAX_ECHO = 1024
# Request headers worth showing in the echo: what the proxy adds or forwards.
ECHO_HEADERS = (
    "host",
    "x-forwarded-for",
    "x-forwarded-proto",
    "x-forwarded-host",
    "x-request-id",
    "content-type",
)


class EchoHandler(BaseHTTPRequestHandler):
    # HTTP/1.1 with Content-Length on every answer: connections are kept alive, as the
    # proxy's upstream pool expects.
    protocol_version = "HTTP/1.1"
    server_version = "tollgate-demo-backend"

    def _read_body(self):
        """Reads the whole body (Content-Length or chunked); returns (size, first bytes)."""
        kept = bytearray()
        size = 0

        def take(n):
            nonlocal size
            while n > 0:
                chunk = self.rfile.read(min(n, 65536))
                if not chunk:
                    raise ConnectionError("body ended early")
                size += len(chunk)
                if len(kept) < MAX_ECHO:
                    kept.extend(chunk[: MAX_ECHO - len(kept)])
                n -= len(chunk)

        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while True:
                line = self.rfile.readline(1024)
                try:
                    n = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise ConnectionError("bad chunk size")
                if n == 0:
                    # Trailers end with an empty line.
                    while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                        pass
                    break
                take(n)
                self.rfile.readline(1024)  # the CRLF after each chunk
        else:
            try:
                length = int(self.headers.get("Content-Length", "0") or "0")
            except ValueError:
                raise ConnectionError("bad Content-Length")
            if length < 0:
                raise ConnectionError("bad Content-Length")
            take(length)
        return size, bytes(kept)

    def _answer(self):
        try:
            size, kept = self._read_body()
        except ConnectionError as e:
            self.send_error(400, str(e))
            self.close_connection = True
            return
        echo = {
            "method": self.command,
            "path": self.path,
            "body_bytes": size,
            "body": kept.decode("utf-8", "replace"),
            "headers": {
                name: self.headers[name] for name in ECHO_HEADERS if name in self.headers
            },
        }
        payload = (json.dumps(echo) + "\n").encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    # Every method a client may send through the proxy answers the same way. (BaseHTTPRequestHandler
    # dispatches on do_<METHOD>; an unknown method would get 501.)
    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _answer

    def log_message(self, format, *args):
        # One line per request on stderr, as http.server does, without the client's address.
        sys.stderr.write("%s\n" % (format % args))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bind", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=9000, help="port (0: any free port)")
    args = parser.parse_args()
    server = ThreadingHTTPServer((args.bind, args.port), EchoHandler)
    server.daemon_threads = True
    host, port = server.server_address[:2]
    print("listening on %s:%d" % (host, port), flush=True)
    # As PID 1 in a container, SIGTERM has no default action: exit on it, so a stop is quick.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server.serve_forever()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
