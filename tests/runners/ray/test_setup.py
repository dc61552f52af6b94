"""Connecting to a Ray cluster: what dsat checks first, says while it waits, and when it gives up."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsat.errors import DsatError
from dsat.runners.ray import setup
from dsat.runners.ray.setup import (
    NOT_THE_GCS,
    answers_http2,
    check_address,
    keep_cluster_reports_in,
    slow_connect_note,
)


def test_a_connect_that_takes_long_says_what_is_likely_wrong(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with slow_connect_note("head:8265", after=0.1):
        time.sleep(0.5)  # ray.init retrying against a port that is not Ray's GCS
    out = capsys.readouterr().out
    assert "still connecting to the Ray cluster at head:8265 after 0 s" in out
    assert "port 6379 by default" in out and "Ctrl-C stops" in out


def test_a_quick_connect_or_a_local_instance_says_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with slow_connect_note("head:6379", after=0.3):
        pass
    with slow_connect_note(None, after=0.0):  # a Ray instance started here: nothing to check
        time.sleep(0.3)
    time.sleep(0.4)
    assert capsys.readouterr().out == ""


@contextlib.contextmanager
def listening(answer: bytes | None) -> Iterator[str]:
    """A server on a free local port that answers each connection with ``answer`` once it has
    read the client's first bytes (None: it says nothing, and holds the connection)."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                connection, _ = server.accept()
                held.append(connection)
                connection.recv(1024)
                if answer is not None:
                    connection.sendall(answer)
                    connection.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()
        for connection in held:
            connection.close()


HTTP1_ANSWER = b"HTTP/1.0 400 Bad request\r\n\r\n<!DOCTYPE html>"
GRPC_SETTINGS = b"\x00\x00\x18\x04\x00\x00\x00\x00\x00" + bytes(24)


def test_an_address_that_answers_in_http1_is_no_ray_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """ray.init retried against it for minutes (the dashboard's port, a web server)."""
    with listening(HTTP1_ANSWER) as address:
        assert answers_http2(address) is False
        with pytest.raises(DsatError) as info:
            check_address(address)
    message = str(info.value)
    assert f"something answers at {address}" in message and "port 6379 by default" in message
    with listening(GRPC_SETTINGS) as address:  # as a GCS answers
        assert answers_http2(address) is True
        check_address(address)
    monkeypatch.setattr(setup, "CONNECT_TIMEOUT_S", 0.3)
    with listening(None) as address:  # says nothing: left to ray.init and its deadline
        assert answers_http2(address) is None
        check_address(address)
    with listening(b"") as address:  # closes at once
        assert answers_http2(address) is None
    with listening(b"\x15\x03\x03\x00\x02\x02\x46") as address:  # a TLS alert: a GCS with TLS
        assert answers_http2(address) is None
    assert answers_http2("ray://head:10001") is None and answers_http2("auto") is None


@pytest.mark.parametrize("address", ["http://127.0.0.1:8265", "HTTPS://head:443"])
def test_a_web_address_says_which_address_to_give(address: str) -> None:
    """Ray's own refusal was cut to its first line: "... To fix this, either:", and no fix."""
    with pytest.raises(DsatError) as info:
        check_address(address)
    message = str(info.value)
    assert message.startswith(f"{address} (--ray-address or RAY_ADDRESS) is a web address")
    assert message.endswith("which needs ray://)") and "\n" not in message


def test_a_connect_that_never_ends_is_given_up_as_a_usage_error() -> None:
    """ray.init cannot be interrupted; nothing of the search has started then."""
    code = (
        "import time\n"
        "from dsat.runners.ray.setup import connect_deadline\n"
        "with connect_deadline('head:8265', after=0.2):\n"
        "    time.sleep(30)\n"
    )
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert run.returncode == 2 and time.monotonic() - started < 20
    assert run.stderr.strip().splitlines() == [
        f"dsat: error: no Ray cluster answered at head:8265 within 0 s (--ray-address or "
        f"RAY_ADDRESS): {NOT_THE_GCS}"
    ]
    quick = "from dsat.runners.ray.setup import connect_deadline\nwith connect_deadline('h:1'):\n    pass"
    assert subprocess.run([sys.executable, "-c", quick], check=False).returncode == 0


def test_what_the_cluster_reports_goes_to_a_log_not_between_dsats_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A node that died put some 45 lines of its raylet's state on the terminal, between dsat's
    own lines, though log_to_driver was off: Ray's error listener prints them itself."""
    import ray._private.worker as ray_worker

    monkeypatch.setattr(ray_worker, "print_to_stdstream", ray_worker.print_to_stdstream)
    keep_cluster_reports_in(tmp_path / "first.log")
    keep_cluster_reports_in(tmp_path / "logs" / "ray-cluster.log")  # a later search's own
    report = {"lines": ["node 3f2a died", "state dump"], "pid": "raylet", "is_err": False}
    ray_worker.print_to_stdstream(report, ignore_prefix=False)  # as the listener calls it
    ray_worker.print_to_stdstream({**report, "pid": 4242, "lines": ["a task's print"]}, False)
    out = capsys.readouterr().out
    # A cluster of an earlier test may report too, at any moment (a worker it killed): only
    # this report's lines are looked for.
    assert "node 3f2a died" not in out and "state dump" not in out and "a task's print" in out
    kept = (tmp_path / "logs" / "ray-cluster.log").read_text()
    assert "node 3f2a died\nstate dump\n" in kept and not (tmp_path / "first.log").exists()
