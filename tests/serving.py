"""Servers for the tests: the real `ds4 serve` in a process, or the app on a thread."""

import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port: int, proc: subprocess.Popen | None = None, timeout: float = 120, log=None) -> None:
    t_end = time.time() + timeout
    while time.time() < t_end:
        if proc is not None and proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"server exited with {proc.returncode}: {log.read()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if json.loads(r.read())["status"] == "ok":
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"server on port {port} did not come up")


class ServerProcess:
    """The real `ds4 serve` in its own process."""

    def __init__(self, *args, env: dict | None = None):
        self.port = free_port()
        self.log = tempfile.TemporaryFile("w+")  # a pipe could fill up and block the server
        self.proc = subprocess.Popen([sys.executable, "-m", "ds4tvm.cli", "serve", *map(str, args), "--port",
                                      str(self.port)], stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env)
        wait_ready(self.port, self.proc, log=self.log)
        self.url = f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> str:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.output()


class InProcessServer:
    """create_app + uvicorn on a thread, for services built around test engines."""

    def __init__(self, service, served: str, keepalive: float = 5.0):
        import uvicorn

        from ds4tvm.server.app import create_app

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(create_app(service, served, keepalive=keepalive),
                                                    host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_ready(self.port)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=20)
