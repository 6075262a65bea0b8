"""Serve a report folder on 127.0.0.1 (stdlib http.server), rebuilding it when the run has moved on.

Reloading the page of a running run shows its newest steps: a request for the page compares the run
directory's signature (metrics, rollouts, config, final/) with the one the report was built from.
"""

from __future__ import annotations

import functools
import os
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from gymv.report.build import build_report
from gymv.report.run import run_signature


class _Handler(SimpleHTTPRequestHandler):
    server: "ReportServer"

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path.split("?", 1)[0] in ("/", "/index.html"):
            self.server.refresh()
        super().do_GET()

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
