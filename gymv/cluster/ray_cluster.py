"""Start a local Ray cluster sized to this machine, or join an existing one, with errors a user can act on.

A cluster started here listens on the loopback interface only. Ray on Linux resolves a node address of
127.0.0.1 to the host's network address (so that other nodes could join) and then binds its GCS, raylet,
workers, dashboard and agents to every interface; its switch for single-machine clusters
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read by the driver and inherited by every Ray process it starts)
keeps them on 127.0.0.1. On a machine without GPUs the cluster's processes start with the CPU actors'
environment (`cpu_env`), so that a CPU actor needs no runtime_env of its own: Ray starts a worker with a
runtime_env through an extra set-up process, which made each actor start about 0.3 s later on 2 cores. A
watcher process (gymv.cluster.reaper) stops the cluster's processes if the driver dies without shutting it
down. A multi-node cluster is opened deliberately: `ray start --head --node-ip-address=IP` on the head,
then `--ray-address IP:PORT` (docs/security.md). Joining one waits at most a deadline (`Deadline`): Ray's
own connect retries for minutes on a port that accepts and never answers as Ray.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

from gymv.cluster_limits import split_address
from gymv.cluster.reaper import start_reaper, stop_reaper
from gymv.errors import GymvError

CONNECT_TIMEOUT_S = 60.0  # cluster.connect_timeout_s's default
NO_PRESTART = "RAY_prestart_worker_first_driver"  # read by the raylet this process starts


@dataclass(frozen=True)
class ClusterInfo:
    address: str
    num_cpus: float
    num_gpus: float
    started_here: bool


@dataclass(frozen=True)
class Deadline:
    """The end of a wait on Ray and the key or flag that sets it, which the error ending the wait names."""

    seconds: float
    key: str
    end: float

    @classmethod
    def after(cls, seconds: float, key: str) -> Deadline:
        return cls(seconds, key, time.monotonic() + seconds)

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def passed(self, address: str, waited_for: str) -> GymvError:
        return GymvError(f"waited {self.seconds:g} s for {waited_for} at {address}", where=self.key, exit_code=1,
                         fix=f"check that {address} is the GCS port of a running Ray head (`ray start --head --port`), "
                             f"or raise {self.key}")


# what an HTTP/2 client says first: the connection preface and an empty SETTINGS frame
_H2_GREETING = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_H2_SETTINGS = 0x04
NOT_GCS_FIX = "give the port the Ray head listens on (`ray start --head --port`, 6379 by default)"


def wait_for_gcs(address: str, deadline: Deadline, where: str, not_gcs_fix: str = NOT_GCS_FIX) -> None:
    """Wait (until `deadline`) for the Ray GCS at HOST:PORT `address` to answer. A GCS is a gRPC server: it
    answers an HTTP/2 greeting with its SETTINGS frame at once, so a port that is closed, silent or speaks
    something else is an error naming it here, not a wait of minutes in Ray's retries."""
    host, port = split_address(address, where)
    try:
        sock = socket.create_connection((host, port), timeout=max(0.01, min(3.0, deadline.left())))
    except OSError as e:
        raise GymvError(f"cannot reach a Ray cluster at {address} ({e.strerror or e})", where=where,
                        fix="start one with `ray start --head`, check HOST:PORT, or drop the address to use a local "
                            "cluster") from None
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        sock.close()  # a TLS GCS waits for the client's hello: the bounded handshake alone checks it
        return
    with sock:
        header = b""
        try:
            sock.sendall(_H2_GREETING)
            while len(header) < 9:
                sock.settimeout(max(0.01, deadline.left()))
                chunk = sock.recv(64)
                if not chunk:
                    break
                header += chunk
        except TimeoutError:
            raise deadline.passed(address, "the Ray GCS's answer (the port accepts and says nothing)") from None
        except OSError:
            pass  # reset or closed: not a GCS
    if len(header) < 9 or header[3] != _H2_SETTINGS:
        shown = repr(header[:40]) if header else "closed the connection"
        raise GymvError(f"{address} answers, but not as a Ray cluster's GCS (gRPC): {shown}", where=where,
                        fix=not_gcs_fix)


T = TypeVar("T")


def _within(deadline: Deadline, address: str, waited_for: str, call: Callable[[], T]) -> T:
    """`call()`, given up at `deadline` (it runs on a daemon thread, left behind then: Ray's calls have no
    deadline of their own)."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    worker = threading.Thread(target=run, name="gymv-ray-connect", daemon=True)
    worker.start()
    worker.join(deadline.left())
    if worker.is_alive():
        raise deadline.passed(address, waited_for)
    if "error" in box:
        raise box["error"]
    return box["value"]


def start_ray(address: str | None = None, *, num_cpus: int | None = None, num_gpus: int | None = None,
              connect_timeout_s: float = CONNECT_TIMEOUT_S, timeout_key: str = "cluster.connect_timeout_s",
              where: str = "--ray-address") -> ClusterInfo:
    """Join `address` (HOST:PORT or 'auto') or start a private local cluster bound to 127.0.0.1. Reaching a
    joined cluster and its handshake take at most `connect_timeout_s` (set by `timeout_key`); `where` names
    the address's source in errors."""
    global _REAPER
    try:
        import ray
    except ImportError as e:  # pragma: no cover - ray is a core dependency
        raise GymvError(f"Ray is not installed ({e})", fix="pip install 'ray[default]'") from None
    if address and address != "auto":
        split_address(address, where)
    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        if address and address != "auto" and not _same_address(address, current):
            raise GymvError(f"this process is already connected to the Ray cluster at {current}, not {address}",
                            fix="run gymv train in a new process, or call ray.shutdown() before joining another "
                                "cluster")
        res = ray.cluster_resources()
        return ClusterInfo(current, res.get("CPU", 0), res.get("GPU", 0), False)
    check_token_path()
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    kwargs = dict(include_dashboard=False, log_to_driver=True, logging_level=logging.ERROR, namespace="gymv")
    if not address:
        loopback_only(ray)
        kwargs["dashboard_host"] = LOOPBACK
    elif address.rpartition(":")[0] in (LOOPBACK, "localhost"):
        loopback_only(ray)  # a cluster on the loopback address: Ray would otherwise dial the host's network address
    joined = _auto_address() if address == "auto" else address
    if joined:
        deadline = Deadline.after(connect_timeout_s, timeout_key)
        wait_for_gcs(joined, deadline, where)
        authenticate(joined, deadline, where)
    try:
        if address:
            if os.environ.get(DRIVER_NODE_IP):  # the node this driver runs on, as the launcher knows it
                kwargs["_node_ip_address"] = os.environ[DRIVER_NODE_IP]
            ray.init(address=address, **kwargs)
            started = False
        else:
            if num_gpus is None:
                num_gpus = _local_gpu_count()
            # Ray starts one idle worker per CPU for the first driver; gymv's actors start workers of their own
            # (its few actors come one per role, when the run asks), so those would only take CPU from them
            os.environ.setdefault(NO_PRESTART, "0")
            inherited = cpu_env() if not num_gpus else {}
            with _environ(inherited):  # what the raylet, and so every worker it starts, inherits
                ray.init(
                    address="local",  # a new cluster: never the machine's `ray start` one, nor RAY_ADDRESS's
                    num_cpus=num_cpus or os.cpu_count() or 1,
                    num_gpus=num_gpus,
                    _node_ip_address=LOOPBACK,
                    **kwargs,
                )
            started = True
            _INHERITED.update(address=ray.get_runtime_context().gcs_address, env=inherited)
            _REAPER = start_reaper()
    except GymvError:
        raise
    except Exception as e:
        raise GymvError(
            f"Ray failed to start: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
            fix="check `ray status`, free disk space in /tmp, or pass --ray-address of a running cluster",
        ) from None
    res = ray.cluster_resources()
    return ClusterInfo(ray.get_runtime_context().gcs_address, res.get("CPU", 0), res.get("GPU", 0), started)


AUTH_MODE, AUTH_TOKEN, AUTH_TOKEN_PATH = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"
TOKEN_FIX = ("export RAY_AUTH_TOKEN=<the cluster's token> (print it on the head with `ray get-auth-token`), or "
             "RAY_AUTH_TOKEN_PATH=<a file holding it>")


def token_source() -> str | None:
    """Where Ray reads a token from, in its own order: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token."""
    if os.environ.get(AUTH_TOKEN):
        return AUTH_TOKEN
    path = os.environ.get(AUTH_TOKEN_PATH)
    if path:
        return f"{AUTH_TOKEN_PATH} ({path})" if os.path.isfile(path) else None
    default = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    return default if os.path.isfile(default) else None


def check_token_path() -> None:
    """A RAY_AUTH_TOKEN_PATH that Ray would read (RAY_AUTH_TOKEN unset) must name a readable file holding a
    token: Ray reports a bad one deep in its start, as a failure to start or to connect."""
    path = os.environ.get(AUTH_TOKEN_PATH)
    if not path or os.environ.get(AUTH_TOKEN):
        return
    try:
        with open(path, "rb") as f:
            held = f.read(1 << 16).strip()
    except OSError as e:
        raise GymvError(f"cannot read the token file {path!r} ({e.strerror or e})", where=AUTH_TOKEN_PATH,
                        fix="point RAY_AUTH_TOKEN_PATH at a readable file holding the cluster's token, or unset it "
                            "and export RAY_AUTH_TOKEN") from None
    if not held:
        raise GymvError(f"the token file {path!r} is empty", where=AUTH_TOKEN_PATH,
                        fix="write the cluster's token into it (`ray get-auth-token` on the head prints it)")


def _auto_address() -> str | None:
    """The HOST:PORT that 'auto' stands for (RAY_ADDRESS, or the cluster `ray start` recorded), if any."""
    try:
        from ray._private.services import canonicalize_bootstrap_address

        return canonicalize_bootstrap_address("auto")
    except Exception:  # noqa: BLE001 - none found, or a Ray without it: ray.init reports it
        return None


def authenticate(address: str, deadline: Deadline, where: str = "--ray-address") -> None:
    """Join a cluster that uses Ray's token authentication: one GCS handshake says in a second what ray.init
    would only report after half a minute as "Failed to connect". A cluster that asks for a token gets the
    one this process was given (gymv turns on Ray's token mode for it); none, or a refused one, is an error
    naming the cause. The handshake waits at most until `deadline`."""
    try:
        from ray._raylet import GcsClient
        from ray.exceptions import AuthenticationError, RpcError
    except ImportError:  # a Ray without token authentication
        return

    def handshake() -> None:
        _within(deadline, address, "the Ray GCS handshake", lambda: GcsClient(address=address))

    try:
        handshake()
        return
    except AuthenticationError:
        pass
    except RpcError as e:
        raise GymvError(f"the Ray GCS handshake with {address} failed: {str(e).splitlines()[0] if str(e) else e!r}",
                        where=where, exit_code=1, fix=NOT_GCS_FIX) from None
    except GymvError:
        raise
    except Exception:
        return  # not an authentication matter: ray.init reports it
    source = token_source()
    if source is None:
        raise GymvError(f"the Ray cluster at {address} requires token authentication and no token was given",
                        where=where, fix=TOKEN_FIX)
    if os.environ.get(AUTH_MODE, "").lower() != "token":
        use_token_auth()
        try:
            handshake()
            return
        except AuthenticationError:
            pass
    raise GymvError(f"the Ray cluster at {address} refused the token from {source}", where=where, fix=TOKEN_FIX)


def use_token_auth() -> None:
    """Ray's token mode for this process and the Ray processes it starts (Ray caches its config: reload it)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    os.environ[AUTH_MODE] = "token"
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


DRIVER_NODE_IP = "GYMV_DRIVER_NODE_IP"  # set by `gymv cluster up`: the head's address, where its command runs
LOOPBACK = "127.0.0.1"
_LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def loopback_only(ray) -> None:
    """Keep a cluster started here on 127.0.0.1: the driver's own switch and its children's environment."""
    os.environ[_LOCAL_ONLY_ENV] = "0"
    constants = getattr(getattr(ray, "_private", None), "ray_constants", None)
    if constants is not None and hasattr(constants, "ENABLE_RAY_CLUSTER"):
        constants.ENABLE_RAY_CLUSTER = False  # read at import; ray may have been imported already


_REAPER = None  # the watcher of a cluster started here (gymv.cluster.reaper)
_INHERITED: dict = {}  # the cluster started here: its GCS address and the environment its workers inherit


def cpu_env() -> dict[str, str]:
    """Environment of CPU actors: passive OpenMP waiting (the user's own setting wins)."""
    return {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}


def cpu_actor_options() -> dict:
    """Ray actor options that give a CPU actor `cpu_env()`: a runtime_env with the variables that the workers
    of the connected cluster do not already inherit (none, on a CPU cluster this process started)."""
    import ray

    inherited = _INHERITED.get("env", {}) if _INHERITED.get("address") == ray.get_runtime_context().gcs_address else {}
    missing = {k: v for k, v in cpu_env().items() if inherited.get(k) != v}
    return {"runtime_env": {"env_vars": missing}} if missing else {}


@contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """`env` set in os.environ for the block, then restored."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _same_address(a: str, b: str) -> bool:
    """HOST:PORT pairs equal, localhost and 127.0.0.1 alike (Ray reports the address it bound)."""
    def norm(x: str) -> tuple[str, str]:
        host, _, port = x.strip().removeprefix("ray://").rpartition(":")
        return ("127.0.0.1" if host == "localhost" else host, port)

    return norm(a) == norm(b)


def stop_ray() -> None:
    import ray

    global _REAPER
    if ray.is_initialized():
        ray.shutdown()
    stop_reaper(_REAPER)
    _REAPER = None
    _INHERITED.clear()


def _local_gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0
