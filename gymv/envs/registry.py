"""Find environments by name: built-ins, in-process registrations and the entry-point group `gymv.envs`, through
the shared `gymv.registry.Registry` (`ENVIRONMENTS`).

A third-party distribution declares, in its pyproject.toml::

    [project.entry-points."gymv.envs"]
    my-env = "my_package.env:MyEnv"

where the object is an Environment subclass or a function returning an Environment. Names compare with
`_` and `-` treated alike (NeMo Gym writes circle_count, gymv circle-count). A built-in name cannot be
taken over by a plugin.
"""

from __future__ import annotations

import inspect
from typing import Any

from gymv.envs.protocol import Environment
from gymv.envs.rows import agent_name
from gymv.errors import GymvError
from gymv.registry import Registry

GROUP = "gymv.envs"

BUILTINS: dict[str, str] = {
    "circle-count": "gymv.envs.circle_count:CircleCount",
    "circle-click": "gymv.envs.circle_click:CircleClick",
    "arithmetic": "gymv.envs.arithmetic:Arithmetic",
    "polygon-naming": "gymv.envs.polygon_naming:PolygonNaming",
    "doorkey": "gymv.envs.doorkey:DoorKey",
    "tangram": "gymv.envs.tangram:Tangram",
    "scripted": "gymv.envs.scripted:Scripted",
}
# Other names for built-ins: NeMo Gym's name of the environment whose rows a built-in serves.
ALIASES: dict[str, str] = {
    "example-multi-turn-gymnasium": "scripted",
}


def normalize(name: str) -> str:
    return name.strip().lower().replace("_", "-")


# where=None: a name comes from env.name, a row's agent_ref.name or the command line
ENVIRONMENTS = Registry("environment", GROUP, BUILTINS, where=None, normalize=normalize, aliases=ALIASES)


def canonical(name: str) -> str:
    """The normalized name with aliases resolved (example_multi_turn_gymnasium -> scripted)."""
    return ENVIRONMENTS.key(name)


def register(name: str, factory: Any) -> None:
    """Register an environment class or factory in this process (tests, notebooks, embedding)."""
    ENVIRONMENTS.register(name, factory)
    _instances.pop(canonical(name), None)


def available() -> dict[str, str]:
    """Every environment name and where it comes from ('builtin', 'registered' or the entry point value)."""
    return ENVIRONMENTS.available()


def _check_kwargs(name: str, factory: Any, kwargs: dict) -> None:
    """Arguments the constructor does not take are the recipe's env.kwargs' fault, not the environment's."""
    if not kwargs or not callable(factory):
        return
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return
    try:
        sig.bind_partial(**kwargs)
    except TypeError as e:
        takes = [p for p in sig.parameters if p not in ("self", "args", "kwargs")]
        raise GymvError(f"environment {name!r} does not take these arguments: {e}", where="env.kwargs",
                        fix=f"its arguments are: {', '.join(takes) or 'none'}") from None


def get_env(name: str, **kwargs: Any) -> Environment:
    """An instance of the named environment; keyword arguments go to its constructor."""
    factory = ENVIRONMENTS.load(name)
    _check_kwargs(name, factory, kwargs)
    try:
        env = factory(**kwargs) if callable(factory) else factory
    except GymvError:
        raise
    except Exception as e:
        raise GymvError(f"environment {name!r} failed to start: {type(e).__name__}: {e}",
                        fix="fix the environment's constructor or its plugin") from None
    if not isinstance(env, Environment):
        raise GymvError(f"environment {name!r} did not produce an Environment (got {type(env).__name__})",
                        fix="its entry point must name an Environment subclass or a function returning one")
    return env


_instances: dict[str, Environment] = {}


def _candidates() -> list[Environment]:
    out = []
    for name in available():
        if name not in _instances:
            try:
                _instances[name] = get_env(name)
            except GymvError:
                continue  # a broken plugin cannot claim rows
        out.append(_instances[name])
    return out


def env_for_agent(agent: str) -> Environment | None:
    """The installed environment an agent name (a row's `agent_ref.name`) names: by its agent or its own name."""
    for env in _candidates():
        if agent == env.agent_name or normalize(agent) == env.name:
            return env
    return None


def env_for_row(row: dict) -> Environment | None:
    """The environment that should score a row: by `agent_ref.name`, else the first whose `matches` holds."""
    agent = agent_name(row)
    env = env_for_agent(agent) if agent is not None else None
    if env is not None:
        return env
    return next((env for env in _candidates() if env.matches(row)), None)
