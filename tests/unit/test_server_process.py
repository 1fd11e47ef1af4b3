"""A server start never measures a server it did not start (ddtree_ops.hostside.server_process,
#47): a port taken before the start, or while the server loads (another process binds it and
even answers /health), fails the start at once naming the port; a server answering with
another model or port is refused. The "server" here is a small Python program that binds
late, as SGLang does (it loads the model first); the real SGLang server meets a squatter in
tests/sglang_server/test_cpu_server_e2e.py."""
from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time

import pytest

from ddtree_ops.hostside import server_process as sp

pytestmark = pytest.mark.slow  # subprocesses that wait a second or two

# Binds `port` after `delay` seconds and answers /health and /server_info as SGLang does.
LATE_SERVER = textwrap.dedent("""
    import json, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    port, delay, model = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    time.sleep(delay)
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass
        def do_GET(self):
            body = b"" if self.path == "/health" else json.dumps({"model_path": model, "port": port}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
    try:
        HTTPServer(("127.0.0.1", port), Handler).serve_forever()
    except OSError as err:
        print(f"[Errno 98] error while attempting to bind: address already in use ({err})", flush=True)
        time.sleep(600)  # as SGLang: logs it and does not exit
""")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_late_server(tmp_path, port: int, delay: float, model: str = "/models/target"):
    return sp.launch([sys.executable, "-c", LATE_SERVER, str(port), str(delay), model], {"PATH": "/usr/bin:/bin"},
                     tmp_path / "server.log", port)


def start_impostor(port: int, model: str = "/models/target") -> subprocess.Popen:
    """Another program's server on the port at once: answers /health, and /server_info with our model."""
    impostor = subprocess.Popen([sys.executable, "-c", LATE_SERVER, str(port), "0", model], start_new_session=True)
    deadline = time.monotonic() + 30
    while sp.port_holders(port) != [impostor.pid]:
        assert time.monotonic() < deadline, "the impostor did not bind its port"
        time.sleep(0.05)
    return impostor


def test_a_port_already_taken_is_refused_before_anything_starts(tmp_path):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(sp.PortTakenError) as caught:
            start_late_server(tmp_path, port, 0)
    assert str(caught.value).startswith(f"port {port} on 127.0.0.1 is not free (held by pid ")
    assert not (tmp_path / "server.log").exists()  # nothing was launched


def test_a_port_taken_while_our_server_loads_fails_at_once_even_if_the_squatter_answers(tmp_path):
    port = free_port()
    process = start_late_server(tmp_path, port, delay=30)
    impostor = start_impostor(port)  # binds first and answers /health and /server_info as if it were ours
    try:
        began = time.monotonic()
        with pytest.raises(sp.PortTakenError) as caught:
            sp.wait_until_serving(process, port, 120, model_path="/models/target", log_path=tmp_path / "server.log",
                                  poll_s=0.2)
        assert time.monotonic() - began < 20
        assert str(caught.value).startswith(f"port {port} was taken by pid {impostor.pid} (")
        assert f"while our server (pid {process.pid}) was starting" in str(caught.value)
    finally:
        sp.stop_process_group(impostor)
        sp.stop_process_group(process)
    assert process.poll() is not None


def test_our_late_binding_server_is_recognised_and_its_identity_checked(tmp_path):
    port = free_port()
    process = start_late_server(tmp_path, port, delay=1)
    try:
        info = sp.wait_until_serving(process, port, 120, model_path="/models/target", poll_s=0.2)
        assert info == {"model_path": "/models/target", "port": port}
        with pytest.raises(sp.NotOurServerError, match=f"port {port}: the server there reports model "
                                                        "'/models/target' on port"):
            sp.check_identity(port, "/models/other", process)
    finally:
        sp.stop_process_group(process)


def test_sglangs_address_in_use_line_fails_the_start_naming_the_port(tmp_path):
    port = free_port()
    process = start_late_server(tmp_path, port, delay=1.5)
    with socket.socket() as squatter:  # a listener our session does not own, invisible to the kernel check
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        original = sp.port_holders
        try:
            sp.port_holders = lambda p: None  # as where /proc/net cannot be read
            with pytest.raises(sp.PortTakenError, match=f"could not bind port {port} \\(address already in use"):
                sp.wait_until_serving(process, port, 120, model_path="/models/target", log_path=tmp_path / "server.log",
                                      poll_s=0.2)
        finally:
            sp.port_holders = original
            sp.stop_process_group(process)


def test_a_server_that_exits_is_reported_with_its_status(tmp_path):
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], start_new_session=True)
    with pytest.raises(RuntimeError, match=r"exited with status 3 before answering on port \d+"):
        sp.wait_until_serving(process, free_port(), 60, model_path="/m", poll_s=0.1)


def test_the_kernel_table_names_the_listener(tmp_path):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        import os

        assert sp.port_holders(port) == [os.getpid()]
        assert sp.describe_pid(os.getpid()).startswith(f"pid {os.getpid()} (")
    assert sp.port_holders(port) == []
