"""Start a local Ray cluster sized to this machine, or join an existing one, with errors a user can act on.

A cluster started here listens on the loopback interface only. Ray on Linux resolves a node address of
127.0.0.1 to the host's network address (so that other nodes could join) and then binds its GCS, raylet,
workers, dashboard and agents to every interface; its switch for single-machine clusters
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read by the driver and inherited by every Ray process it starts)
keeps them on 127.0.0.1. A watcher process (gymv.cluster.reaper) stops the cluster's processes if the
driver dies without shutting it down. A multi-node cluster is opened deliberately: `ray start --head
--node-ip-address=IP` on the head, then `--ray-address IP:PORT` (docs/security.md).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

from gymv.cluster.reaper import start_reaper, stop_reaper
from gymv.errors import GymvError


@dataclass(frozen=True)
class ClusterInfo:
    address: str
    num_cpus: float
    num_gpus: float
    started_here: bool


def _check_reachable(address: str, timeout_s: float = 3.0) -> None:
    """Ray waits minutes on an address nobody listens on; a plain TCP connect fails in a moment."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise GymvError(f"bad Ray address {address!r}", fix="use HOST:PORT, e.g. 127.0.0.1:6379, or 'auto'")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise GymvError(
            f"cannot reach a Ray cluster at {address} ({e.strerror or e})",
            fix="start one with `ray start --head` or drop --ray-address to use a local cluster",
        ) from None


def start_ray(address: str | None = None, *, num_cpus: int | None = None, num_gpus: int | None = None) -> ClusterInfo:
    """Join `address` (HOST:PORT or 'auto') or start a private local cluster bound to 127.0.0.1."""
    global _REAPER
    try:
        import ray
    except ImportError as e:  # pragma: no cover - ray is a core dependency
        raise GymvError(f"Ray is not installed ({e})", fix="pip install 'ray[default]'") from None
    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        if address and address != "auto" and not _same_address(address, current):
            raise GymvError(f"this process is already connected to the Ray cluster at {current}, not {address}",
                            fix="run gymv train in a new process, or call ray.shutdown() before joining another "
                                "cluster")
        res = ray.cluster_resources()
        return ClusterInfo(current, res.get("CPU", 0), res.get("GPU", 0), False)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    kwargs = dict(include_dashboard=False, log_to_driver=True, logging_level=logging.ERROR, namespace="gymv")
    if not address:
        loopback_only(ray)
        kwargs["dashboard_host"] = LOOPBACK
    elif address.rpartition(":")[0] in (LOOPBACK, "localhost"):
        loopback_only(ray)  # a cluster on the loopback address: Ray would otherwise dial the host's network address
    if address and address != "auto":
        _check_reachable(address)
        authenticate(address)
    try:
        if address:
            if os.environ.get(DRIVER_NODE_IP):  # the node this driver runs on, as the launcher knows it
                kwargs["_node_ip_address"] = os.environ[DRIVER_NODE_IP]
            ray.init(address=address, **kwargs)
            started = False
        else:
            if num_gpus is None:
                num_gpus = _local_gpu_count()
            ray.init(
                address="local",  # a new cluster: never the machine's `ray start` one, nor RAY_ADDRESS's
                num_cpus=num_cpus or os.cpu_count() or 1,
                num_gpus=num_gpus,
                _node_ip_address=LOOPBACK,
                **kwargs,
            )
            started = True
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


def authenticate(address: str) -> None:
    """Join a cluster that uses Ray's token authentication: one GCS handshake says in a second what ray.init
    would only report after half a minute as "Failed to connect". A cluster that asks for a token gets the
    one this process was given (gymv turns on Ray's token mode for it); none, or a refused one, is an error
    naming the cause."""
    try:
        from ray._raylet import GcsClient
        from ray.exceptions import AuthenticationError
    except ImportError:  # a Ray without token authentication
        return
    try:
        GcsClient(address=address)
        return
    except AuthenticationError:
        pass
    except Exception:
        return  # not an authentication matter: ray.init reports it
    source = token_source()
    if source is None:
        raise GymvError(f"the Ray cluster at {address} requires token authentication and no token was given",
                        where="--ray-address", fix=TOKEN_FIX)
    if os.environ.get(AUTH_MODE, "").lower() != "token":
        use_token_auth()
        try:
            GcsClient(address=address)
            return
        except AuthenticationError:
            pass
    raise GymvError(f"the Ray cluster at {address} refused the token from {source}", where="--ray-address",
                    fix=TOKEN_FIX)


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


def _local_gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0
