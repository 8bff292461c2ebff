"""The fleet: which models are resident, each as its own ``pagedllm serve`` on a loopback port,
and the one budget they share with the front.

Invariant: ``reserve + sum(share of each resident model) <= budget``, where a model's share is
the ``--memory`` its server was started with (or shrunk to), and a server's whole process tree
stays within its ``--memory`` (the single-model server's promise). Loads and unloads happen one
at a time under ``_lock``; a request for a resident model takes no lock.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from .models import ModelSpec
from .planning import LAUNCH, ModelPlan

log = logging.getLogger(__name__)


class FleetError(Exception):
    """A request the fleet cannot serve now (a 503 to the client, with the reason)."""


@dataclass
class Resident:
    """A model's running server."""

    proc: subprocess.Popen
    url: str
    share: int
    log_path: str
    in_flight: int = 0
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class Entry:
    spec: ModelSpec
    plan: ModelPlan
    pinned: bool = False
    state: str = "on disk"  # "loading", "resident", "unloading"
    resident: Resident | None = None
    loads: int = 0
    last_switch_s: float = 0.0  # the last load's time: room made, server started, healthy


class Fleet:
    def __init__(
        self,
        entries: list[Entry],
        budget: int,
        reserve: int,
        child_flags: list[str],
        *,
        keep_alive: float | None = None,
        load_timeout: float = 300.0,
        shutdown_timeout: float = 30.0,
    ):
        """``reserve``: the front's own memory, out of ``budget``; ``child_flags``: the engine and
        server flags every model's server gets; ``keep_alive``: seconds idle before an unpinned
        model is unloaded (None: only to make room)."""
        self.entries = {e.spec.name: e for e in entries}
        self.budget, self.reserve, self.child_flags = budget, reserve, child_flags
        self.keep_alive, self.load_timeout, self.shutdown_timeout = keep_alive, load_timeout, shutdown_timeout
        self._lock = asyncio.Lock()
        self.unloads = 0
        self.api_key: str | None = None  # the servers' key (the front's own), for the fleet's own calls
        self._spawned: list[subprocess.Popen] = []  # every server started, a loading one too: stop_all ends them

    # ---- requests ----------------------------------------------------------------------------

    async def acquire(self, name: str) -> Resident:
        """The model's server, resident (loaded first where it is not); counted in flight until
        ``release``. FleetError where it cannot be loaded within ``load_timeout``. A request
        that waited for a load is counted in flight under the same lock, before any other load
        may choose its model to unload: two models' waiters cannot evict each other's in turn."""
        entry = self.entries[name]
        if entry.state == "resident" and entry.resident is not None:
            return self._hold(entry.resident)
        deadline = time.monotonic() + self.load_timeout
        try:
            return await asyncio.wait_for(self._load_and_hold(entry, deadline), self.load_timeout)
        except asyncio.TimeoutError:
            raise FleetError(f"model {name!r} was not loaded within {self.load_timeout:.0f} s") from None

    @staticmethod
    def _hold(resident: Resident) -> Resident:
        resident.in_flight += 1
        resident.last_used = time.monotonic()
        return resident

    def release(self, resident: Resident) -> None:
        resident.in_flight -= 1
        resident.last_used = time.monotonic()

    # ---- residency ---------------------------------------------------------------------------

    @property
    def free_bytes(self) -> int:
        return self.budget - self.reserve - sum(e.resident.share for e in self.entries.values() if e.resident)

    async def _load_and_hold(self, entry: Entry, deadline: float) -> Resident:
        async with self._lock:
            if entry.state != "resident" or entry.resident is None:
                started = time.monotonic()
                await self._make_room(entry, deadline)
                entry.state, share = "loading", self.free_bytes
                try:
                    entry.resident = await self._start(entry, share, deadline)
                except BaseException:
                    entry.state = "on disk"
                    raise
                entry.state, entry.loads = "resident", entry.loads + 1
                entry.last_switch_s = time.monotonic() - started
                log.warning("loaded %s in %.1f s (share %d bytes)", entry.spec.name, entry.last_switch_s, share)
            return self._hold(entry.resident)

    async def _make_room(self, entry: Entry, deadline: float) -> None:
        """Until ``entry`` fits: the other resident models shrunk to their need (elastic) where
        that alone makes room, else the least recently used unpinned one unloaded (after its
        requests finish) and the question asked again. A model about to be unloaded is not
        shrunk first: that would only cost its server a re-plan."""
        need = entry.plan.need_bytes
        while self.free_bytes < need:
            others = sorted(self._residents(exclude=entry), key=_last_used)
            reclaimable = sum(max(0, e.resident.share - e.plan.need_bytes) for e in others if e.resident)
            if self.free_bytes + reclaimable >= need:
                for other in others:
                    if self.free_bytes < need:
                        await self._shrink(other)
                if self.free_bytes >= need:
                    return
            victims = [e for e in others if not e.pinned]
            if not victims:
                raise FleetError(
                    f"model {entry.spec.name!r} needs {need} bytes; {self.free_bytes} are free and every "
                    "other resident model is pinned"
                )
            await self._unload(victims[0], deadline)

    def _residents(self, exclude: Entry) -> list[Entry]:
        return [e for e in self.entries.values() if e is not exclude and e.resident is not None]

    async def _shrink(self, entry: Entry) -> None:
        resident = entry.resident
        assert resident is not None
        need = entry.plan.need_bytes
        if resident.share <= need:
            return
        async with httpx.AsyncClient(timeout=60) as client:
            answer = await client.post(resident.url + "/v1/memory", json={"memory": need}, headers=self._key())
        if answer.status_code == 200:
            log.warning("shrank %s from %d to %d bytes", entry.spec.name, resident.share, need)
            resident.share = need
        else:  # it stays as it is; unloading is the next way to make room
            log.warning("could not shrink %s: %s", entry.spec.name, answer.text[:200])

    async def _unload(self, entry: Entry, deadline: float | None = None) -> None:
        """New requests for it wait (``acquire`` sees it not resident); those in flight finish."""
        resident = entry.resident
        assert resident is not None
        entry.state = "unloading"
        while resident.in_flight and (deadline is None or time.monotonic() < deadline):
            await asyncio.sleep(0.02)
        started = time.monotonic()
        await asyncio.to_thread(_stop, resident.proc, self.shutdown_timeout)
        entry.resident, entry.state = None, "on disk"
        self.unloads += 1
        log.warning("unloaded %s in %.2f s", entry.spec.name, time.monotonic() - started)

    async def _start(self, entry: Entry, share: int, deadline: float) -> Resident:
        port_file = tempfile.NamedTemporaryFile(prefix="pagedllm-fleet-port-", delete=False).name
        os.unlink(port_file)
        log_file = tempfile.NamedTemporaryFile("w", prefix=f"pagedllm-fleet-{entry.spec.name}-", delete=False)
        flags = ["--model", entry.spec.path, "--served-model-name", entry.spec.name, "--memory", str(share)]
        command = [sys.executable, *LAUNCH, "serve", *flags, "--port", "0", "--port-file", port_file]
        proc = subprocess.Popen(command + self.child_flags, stdout=log_file, stderr=subprocess.STDOUT)
        log_file.close()
        self._spawned = [p for p in self._spawned if p.poll() is None] + [proc]
        try:
            return await self._until_healthy(entry, proc, port_file, log_file.name, share, deadline)
        except BaseException:  # not healthy in time, or the waiting request gave up: no server left behind
            await asyncio.to_thread(_stop, proc, 5)
            raise

    async def _until_healthy(
        self, entry: Entry, proc: subprocess.Popen, port_file: str, log_path: str, share: int, deadline: float
    ) -> Resident:
        url = ""
        async with httpx.AsyncClient(timeout=2) as client:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise FleetError(f"model {entry.spec.name!r} failed to start: {_tail(log_path)}")
                if not url and os.path.exists(port_file) and open(port_file).read().endswith("\n"):
                    url = f"http://127.0.0.1:{int(open(port_file).read())}"
                    os.unlink(port_file)
                if url:
                    try:
                        if (await client.get(url + "/health")).status_code == 200:
                            return Resident(proc, url, share, log_path)
                    except httpx.HTTPError:
                        pass
                await asyncio.sleep(0.1)
        raise FleetError(f"model {entry.spec.name!r} did not start in time: {_tail(log_path)}")

    def _key(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    # ---- life --------------------------------------------------------------------------------

    async def keep_alive_loop(self) -> None:
        """Unloads unpinned models idle for longer than ``keep_alive``."""
        if self.keep_alive is None:
            return
        while True:
            await asyncio.sleep(min(1.0, self.keep_alive / 4))
            now = time.monotonic()
            for entry in list(self.entries.values()):
                r = entry.resident
                if r is not None and not entry.pinned and not r.in_flight and now - r.last_used > self.keep_alive:
                    async with self._lock:
                        if entry.resident is r and not r.in_flight:
                            await self._unload(entry)

    async def stop_all(self) -> None:
        """Every model's server drained (SIGTERM: what is in flight finishes) and gone, one still
        loading included (its load then fails: nobody waits for it any more)."""
        procs = [p for p in self._spawned if p.poll() is None]
        await asyncio.gather(*(asyncio.to_thread(_stop, proc, self.shutdown_timeout) for proc in procs))
        for e in self.entries.values():
            e.resident, e.state = None, "on disk"

    def listing(self) -> list[dict]:
        return [
            {
                "id": e.spec.name,
                "object": "model",
                "created": 0,
                "owned_by": "pagedllm",
                "state": e.state,
                "pinned": e.pinned,
                "max_model_len": e.plan.max_model_len,
                "planned_bytes": e.plan.full_bytes,
                "need_bytes": e.plan.need_bytes,
                "weights_bytes": e.plan.weights_bytes,
                "share_bytes": e.resident.share if e.resident else 0,
                "loads": e.loads,
                "last_switch_seconds": round(e.last_switch_s, 3),
            }
            for e in self.entries.values()
        ]


def _last_used(entry: Entry) -> float:
    return entry.resident.last_used if entry.resident is not None else 0.0


def _stop(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM (the server drains), then SIGKILL if it outlives ``timeout`` (+ its engine's exit)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout + 15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tail(path: str, chars: int = 600) -> str:
    try:
        return " ".join(open(path).read().split())[-chars:]
    except OSError:
        return ""
