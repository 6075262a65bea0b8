"""`gymv report --serve` serves regular files inside the report folder only; the build never follows a
`report/` link out of the run. Real HTTP on 127.0.0.1, real symbolic links."""

from __future__ import annotations

import http.client
import threading

import pytest

from gymv.errors import GymvError
from gymv.report import build_report, serve_report
from report_run import make_run


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    base = tmp_path_factory.mktemp("served")
    run = make_run(base / "run", steps=2)
    out = base / "out"
    build_report(run, out)
    secret = base / "secret.txt"
    secret.write_text("private")
    (out / "leak.txt").symlink_to(secret)
    (out / "outside").symlink_to(base)
    server = serve_report(out)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, out
    server.shutdown()
    server.server_close()


def fetch(server, path: str, host: str | None = None) -> tuple[int, bytes]:
    host_, port = server.server_address[:2]
    conn = http.client.HTTPConnection(host_, port, timeout=10)
    conn.putrequest("GET", path, skip_host=host is not None)
    if host is not None:
        conn.putheader("Host", host)
    conn.endheaders()
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, body


def test_the_page_and_its_files_are_served(served):
    server, _ = served
    assert fetch(server, "/")[0] == 200
    status, body = fetch(server, "/data.js")
    assert status == 200 and body.startswith(b"window.GYMV_REPORT")


@pytest.mark.parametrize("path", ["/leak.txt", "/outside/secret.txt", "/outside/", "/plots/", "/plots",
                                  "/../secret.txt", "/%2e%2e/secret.txt", "/plots/%2e%2e/%2e%2e/secret.txt"])
def test_links_out_listings_and_dot_segments_are_not_found(served, path):
    server, _ = served
    status, body = fetch(server, path)
    assert status == 404 and b"private" not in body and b"<title>Directory listing" not in body


def test_a_foreign_host_name_is_refused_on_a_loopback_server(served):
    server, _ = served
    assert fetch(server, "/", host="evil.example:80")[0] == 400
    assert fetch(server, "/", host=f"localhost:{server.server_address[1]}")[0] == 200


def test_the_build_refuses_a_report_link_out_of_the_run(tmp_path):
    run = make_run(tmp_path / "run", steps=1)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "report").symlink_to(elsewhere)
    with pytest.raises(GymvError, match="report: is a symbolic link"):
        build_report(run)
    assert list(elsewhere.iterdir()) == []


def test_an_image_too_large_to_view_is_not_copied_into_the_report(tmp_path):
    import base64
    import io

    from PIL import Image

    from gymv.report.viewer import ImageStore

    buf = io.BytesIO()
    Image.new("1", (20000, 20000)).save(buf, "PNG")  # about 50 KB on disk, 400 megapixels in a browser
    store = ImageStore(tmp_path)
    part = store.save("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    assert "400000000 pixels, over the" in part["missing"] and store.refused == 1
    assert not (tmp_path / "images").exists()
