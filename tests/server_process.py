"""ServerProcess: `pagedllm serve` in a subprocess on a free loopback port, for the soak
generator and the tests, which need a real server (its own process, signals, RSS).

Its output goes to a file, not a pipe: nobody reads a pipe during a long run, and a full pipe
would block the server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text to {name: value} (labels dropped); HTTP errors keep their status label."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        name = key.split("{", 1)[0]
        out[key if name.startswith("pagedllm_http_errors") else name] = float(value)
    return out


def tree_rss(pid: int) -> int:
    """The resident bytes of ``pid`` and every process under it (a server's whole tree)."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
            for task in os.listdir(f"/proc/{p}/task"):
                stack += [int(c) for c in open(f"/proc/{p}/task/{task}/children").read().split()]
        except (OSError, StopIteration):
            continue
    return total


class ServerProcess:
    def __init__(self, *args: str, startup_timeout: float = 300, prelude: str = ""):
        """``prelude``: Python run at start-up in every process of the server, the engine's
        included (a test's fault), as a ``sitecustomize`` module on PYTHONPATH."""
        # port 0: the server binds any free port and writes it to port_file (no pick-then-bind race)
        self.port_file = tempfile.NamedTemporaryFile(prefix="pagedllm-port-", delete=False).name
        os.unlink(self.port_file)
        launcher = ["-c", "import sys\nfrom pagedllm.cli import main\nsys.exit(main(sys.argv[1:]))"]
        self.command = [sys.executable, *launcher, "serve", "--port", "0", "--port-file", self.port_file, *args]
        self.url = ""
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pagedllm-serve-", suffix=".log", delete=False)
        env = os.environ.copy()
        self.prelude_dir = None
        if prelude:
            self.prelude_dir = tempfile.TemporaryDirectory(prefix="pagedllm-prelude-")
            with open(os.path.join(self.prelude_dir.name, "sitecustomize.py"), "w") as f:
                f.write(prelude)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [self.prelude_dir.name, env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.pid = self.proc.pid
        self._wait_healthy(startup_timeout)

    def engine_pid(self) -> int | None:
        """The engine's process (the server's child), or None when it steps on a thread."""
        children = open(f"/proc/{self.pid}/task/{self.pid}/children").read().split()
        return int(children[0]) if children else None

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early ({self.proc.returncode}):\n{self.log_tail()}")
            if not self.url:
                if os.path.exists(self.port_file) and open(self.port_file).read().endswith("\n"):
                    self.url = f"http://127.0.0.1:{int(open(self.port_file).read())}"
                    os.unlink(self.port_file)
                else:
                    time.sleep(0.05)
                    continue
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        with open(self.log.name) as f:
            return "".join(f.readlines()[-lines:])

    def metric(self, name: str, headers: dict | None = None) -> float:
        """One value from /metrics."""
        return parse_metrics(httpx.get(self.url + "/metrics", headers=headers, timeout=10).text)[name]

    def stop(self, timeout: float = 60, keep_log: bool = False) -> int:
        """SIGTERM (the server drains and exits 0), then a kill if it does not exit in time;
        returns the exit status. The log is deleted unless kept (to show after a failure)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        if not keep_log:
            self.remove_log()
        return self.proc.returncode

    def remove_log(self) -> None:
        if os.path.exists(self.log.name):
            os.unlink(self.log.name)
