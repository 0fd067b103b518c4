"""Fixtures: the `moeflux` binary serving the converted tiny fixture model
(random weights, with the Qwen3.5 chat template so tools render) on
127.0.0.1 at a free port chosen by the server (`--port 0`)."""

import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("MOEFLUX_BIN", ROOT / "target" / "debug" / "moeflux"))
FIXTURES = ROOT / "tests" / "fixtures"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "browser: the chat page in Chromium (tests/server/browser.sh)")


@pytest.fixture(scope="session")
def model_dir():
    tmp = Path(tempfile.mkdtemp(prefix="moeflux-serve-test-"))
    dst = tmp / "tiny-qwen"
    subprocess.run(
        [str(BIN), "convert", str(FIXTURES / "qwen35moe-q4" / "src"), str(dst)],
        check=True,
        capture_output=True,
    )
    shutil.copy(FIXTURES / "templates" / "qwen3.5" / "chat_template.jinja", dst)
    yield dst
    shutil.rmtree(tmp, ignore_errors=True)


class Server:
    def __init__(self, model_dir, *args):
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [str(BIN), "serve", "--model", str(model_dir), "--port", "0",
             "--backend", "cpu", "--threads", "2", "--ctx-size", "4096", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        # The first stderr line names the address.
        deadline = time.time() + 60
        said = b""
        while time.time() < deadline:
            line = self.proc.stderr.readline()
            said += line
            m = re.search(rb"listening on http://([\d.]+):(\d+)", line)
            if m:
                self.host, self.port = m.group(1).decode(), int(m.group(2))
                break
            if not line and self.proc.poll() is not None:
                break
        else:
            self.stop()
            raise RuntimeError("server did not start")
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited: {said + self.proc.stderr.read()!r}")
        self.url = f"http://{self.host}:{self.port}"
        self.pid = self.proc.pid

    def rss_kib(self):
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def metrics(self):
        with urllib.request.urlopen(self.url + "/metrics") as r:
            out = {}
            for line in r.read().decode().splitlines():
                if line and not line.startswith("#"):
                    name, value = line.rsplit(" ", 1)
                    out[name] = float(value)
            return out

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        assert self.proc.returncode == 0, self.proc.returncode  # SIGTERM: a clean stop


@pytest.fixture(scope="session")
def server(model_dir):
    s = Server(model_dir)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def auth_server(model_dir):
    s = Server(model_dir, "--api-key", "test-key")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def load_server(model_dir):
    # A short queue (so some requests are refused) and a small prefix cache.
    s = Server(model_dir, "--max-queue", "4", "--prefix-cache", "4M")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def parallel_server(model_dir):
    # Four slots, prompts prefilled in small chunks beside the others' decoding.
    s = Server(model_dir, "--parallel", "4", "--step-tokens", "16")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def alone_server(model_dir):
    s = Server(model_dir, "--parallel", "1", "--no-prefix-reuse")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def no_ui_server(model_dir):
    s = Server(model_dir, "--no-ui")
    yield s
    s.stop()
