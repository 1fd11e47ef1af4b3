"""#49 item 7 in the real sglang 0.5.23 server on CPU: with DDTREE_ENABLE=1 DDTREE_STRICT=1, a
register() that fails (here one of the plugin's modules cannot import, as a broken install
would make it) stops the server at start with one line naming the failure; before, SGLang's
load_plugins() logged and swallowed it and the server served plain DFlash.

The failure is injected by a `sitecustomize` on PYTHONPATH, which every process the server
starts runs; nothing of SGLang or of the plugin is changed. Cheap: the launcher stops at its
first load_plugins(), before any model is loaded."""
from __future__ import annotations

import subprocess
import time
import urllib.request

import pytest

from .cpu_server import cpu_env_python, free_port, launch_argv, server_env, write_models

pytestmark = pytest.mark.slow
EXIT_WITHIN_S = 600  # wide: a cold start of the server's imports beside busy loops


def served(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
            return reply.status == 200
    except OSError:
        return False


def test_a_strict_server_whose_register_fails_stops_with_one_line(tmp_path):
    from ddtree_ops.hostside.server_process import stop_process_group

    python = cpu_env_python()
    models = write_models(python, tmp_path / "models")
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text("import sys\nsys.modules['ddtree.sglang.targets'] = None\n")
    env = server_env({"DDTREE_ENABLE": "1", "DDTREE_STRICT": "1", "PYTHONPATH": str(tmp_path / "inject")})
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(launch_argv(python, models, port, speculative=True), stdout=out,
                                   stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + EXIT_WITHIN_S
        while process.poll() is None and time.monotonic() < deadline:
            assert not served(port), "the server came up serving without DDTree"
            time.sleep(1)
        text = log.read_text(errors="replace")
        assert process.returncode not in (None, 0), text[-3000:]
    finally:
        stop_process_group(process)
    stops = [line for line in text.splitlines() if line.startswith("ddtree.sglang.errors.PluginRegisterError: ")]
    assert stops == ["ddtree.sglang.errors.PluginRegisterError: DDTree plugin: register() failed: ModuleNotFoundError: "
                     "import of ddtree.sglang.targets halted; None in sys.modules (DDTREE_STRICT=1: stopping instead "
                     "of serving plain DFlash; DDTREE_STRICT=0 serves without DDTree)"], text[-3000:]
