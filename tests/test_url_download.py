"""`url_download` against a local HTTP server: a dropped connection is resumed with a Range request (not restarted),
503s are tried again, a 404 is one UserError, and a file is only ever renamed into place complete and checked."""

from __future__ import annotations

import hashlib
import os
import random
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from litgpt import fetch
from litgpt.fetch import url_download
from litgpt.errors import UserError

DATA = random.Random(0).randbytes(300_000)


class Server:
    """Serves DATA; each path behaves in its own way. Counts the body bytes sent and the requests per path."""

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.requests: dict[str, list] = {}
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                owner.handle(self)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.http.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http.server_address[1]}/{path}"

    def handle(self, handler: BaseHTTPRequestHandler) -> None:
        path = handler.path.lstrip("/")
        seen = self.requests.setdefault(path, [])
        seen.append(handler.headers.get("Range"))
        if path == "missing":
            return handler.send_error(404)
        if path == "busy" and len(seen) <= 2:
            handler.send_response(503)
            handler.send_header("Retry-After", "0")
            handler.send_header("Content-Length", "0")
            return handler.end_headers()
        start = int(seen[-1].removeprefix("bytes=").rstrip("-")) if seen[-1] and path != "norange" else 0
        if start >= len(DATA):
            handler.send_response(416)
            handler.send_header("Content-Range", f"bytes */{len(DATA)}")
            handler.send_header("Content-Length", "0")
            return handler.end_headers()
        handler.send_response(206 if start else 200)
        if start:
            handler.send_header("Content-Range", f"bytes {start}-{len(DATA) - 1}/{len(DATA)}")
        handler.send_header("Content-Length", str(len(DATA) - start))
        handler.end_headers()
        body = DATA[start:]
        if path == "drop" and len(seen) == 1:  # half the file, then the connection goes away
            body = body[: len(body) // 2]
        self.bytes_sent += len(body)  # before the client can have read it all
        handler.wfile.write(body)
        handler.wfile.flush()
        if path == "drop" and len(seen) == 1:
            handler.connection.shutdown(socket.SHUT_RDWR)
            handler.close_connection = True


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")  # urllib would send the requests to a proxy
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setattr(fetch, "BACKOFF_SECONDS", 0.01)
    serving = Server()
    yield serving
    serving.http.shutdown()
    serving.http.server_close()


def test_a_dropped_connection_is_resumed_not_restarted(server, tmp_path, capsys):
    target = tmp_path / "sub" / "data.bin"
    url_download(server.url("drop"), target, sha256=hashlib.sha256(DATA).hexdigest())
    assert target.read_bytes() == DATA
    assert server.requests["drop"] == [None, f"bytes={len(DATA) // 2}-"]
    assert server.bytes_sent == len(DATA)  # each byte sent once
    assert not (tmp_path / "sub" / "data.bin.part").exists()
    assert "trying again" in capsys.readouterr().err


def test_a_partial_file_left_behind_is_resumed(server, tmp_path):
    target = tmp_path / "data.bin"
    (tmp_path / "data.bin.part").write_bytes(DATA[:123_456])
    url_download(server.url("plain"), target, size=len(DATA))
    assert target.read_bytes() == DATA
    assert server.requests["plain"] == ["bytes=123456-"] and server.bytes_sent == len(DATA) - 123_456


def test_a_complete_partial_file_is_taken_and_a_server_without_ranges_starts_over(server, tmp_path):
    (tmp_path / "whole.bin.part").write_bytes(DATA)
    url_download(server.url("plain"), tmp_path / "whole.bin")  # 416: nothing left to send
    assert (tmp_path / "whole.bin").read_bytes() == DATA and server.bytes_sent == 0

    (tmp_path / "again.bin.part").write_bytes(b"stale bytes")
    url_download(server.url("norange"), tmp_path / "again.bin")
    assert (tmp_path / "again.bin").read_bytes() == DATA


def test_503_twice_then_200(server, tmp_path):
    url_download(server.url("busy"), tmp_path / "data.bin")
    assert (tmp_path / "data.bin").read_bytes() == DATA and len(server.requests["busy"]) == 3


def test_404_is_one_user_error_and_writes_nothing(server, tmp_path):
    with pytest.raises(UserError, match=r"Could not download http://127\.0\.0\.1:\d+/missing \(HTTP 404 Not Found\)\. "
                                        r"Download it yourself and put it at .*data\.bin'\.$"):
        url_download(server.url("missing"), tmp_path / "data.bin")
    assert os.listdir(tmp_path) == [] and len(server.requests["missing"]) == 1


def test_a_wrong_hash_is_reported_and_the_bytes_dropped(server, tmp_path):
    with pytest.raises(UserError, match="corrupt: its SHA-256 is"):
        url_download(server.url("plain"), tmp_path / "data.bin", sha256="0" * 64)
    assert os.listdir(tmp_path) == []


def test_an_existing_file_is_kept_without_the_network(server, tmp_path):
    (tmp_path / "data.bin").write_bytes(b"mine")
    url_download(server.url("plain"), tmp_path / "data.bin")
    assert (tmp_path / "data.bin").read_bytes() == b"mine" and server.requests == {}


def test_gives_up_after_the_last_try(server, tmp_path, monkeypatch):
    monkeypatch.setattr(fetch, "DOWNLOAD_ATTEMPTS", 2)
    with pytest.raises(UserError, match=r"HTTP 503 .*gave up after 2 tries"):
        url_download(server.url("busy"), tmp_path / "data.bin")
