"""Serve a report folder on 127.0.0.1 (stdlib http.server), rebuilding it when the run has moved on.

Reloading the page of a running run shows its newest steps: a request for the page compares the run
directory's signature (metrics, rollouts, config, final/) with the one the report was built from.
"""

from __future__ import annotations

import functools
import os
import stat
import threading
import urllib.parse
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from gymv.net import host_allowed
from gymv.report.build import build_report
from gymv.report.run import run_signature


class _Handler(SimpleHTTPRequestHandler):
    """Regular files inside the report folder, nothing else: no directory listings, no symbolic links (a
    link inside the folder could point anywhere on the machine), no dot-segments, no other Host."""

    server: "ReportServer"

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path.split("?", 1)[0] in ("/", "/index.html"):
            self.server.refresh()
        super().do_GET()

    def _host_ok(self) -> bool:
        """On a loopback address, only loopback names: a page elsewhere cannot rebind its own name to us."""
        return host_allowed(self.server.server_address[0], self.headers.get("Host"))

    def _file(self) -> Path | None:
        """The regular file the request names inside the root, or None."""
        raw = urllib.parse.unquote(self.path.split("?", 1)[0].split("#", 1)[0])
        parts = [p for p in raw.split("/") if p] or ["index.html"]
        if any(p in (".", "..") or "\\" in p or "\0" in p for p in parts):
            return None
        path = self.server.root
        for part in parts:
            path = path / part
            if path.is_symlink():
                return None
        return path if path.is_file() else None

    def send_head(self):
        if not self._host_ok():
            self.send_error(400, "Host not allowed")
            return None
        path = self._file()
        if path is None:
            self.send_error(404, "File not found")
            return None
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            self.send_error(404, "File not found")
            return None
        f = os.fdopen(fd, "rb")
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            f.close()
            self.send_error(404, "File not found")
            return None
        self.send_response(200)
        self.send_header("Content-type", self.guess_type(str(path)))
        self.send_header("Content-Length", str(st.st_size))
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        return f

    def end_headers(self) -> None:
        self.send_header("Cache-Control", "no-store")  # a reload must show the rebuilt plots
        super().end_headers()

    def log_message(self, format: str, *args) -> None:  # noqa: A002
        pass


class ReportServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, run_dir: Path | None, out_dir: Path, host: str, port: int, signature: tuple | None = None,
                 build_options: dict | None = None):
        self.run_dir, self.out_dir = run_dir, out_dir
        self.root = Path(os.path.realpath(out_dir))
        self.build_options = dict(build_options or {})  # build_report's smoothing and compare, kept on rebuilds
        self._lock = threading.Lock()
        self._built = signature if signature is not None or run_dir is None else run_signature(run_dir)
        self.rebuilds = 0
        super().__init__((host, port), functools.partial(_Handler, directory=str(out_dir)))

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/"

    def refresh(self) -> None:
        if self.run_dir is None:
            return
        with self._lock:
            sig = run_signature(self.run_dir)
            if sig != self._built:
                build_report(self.run_dir, self.out_dir, **self.build_options)
                self._built = sig
                self.rebuilds += 1


def serve_report(out_dir: str | os.PathLike, run_dir: str | os.PathLike | None = None, *, host: str = "127.0.0.1",
                 port: int = 0, signature: tuple | None = None, build_options: dict | None = None) -> ReportServer:
    """A server for `out_dir` (call serve_forever(); port 0 picks a free one). With `run_dir`, the report is
    rebuilt on a page request whenever the run has written something new since the last build; pass the
    `run_signature` taken before that build, so a step logged while it was being built is not missed."""
    return ReportServer(Path(run_dir) if run_dir is not None else None, Path(out_dir), host, port, signature, build_options)
