"""Row -> environment: the environment a run's `env:` section describes (`make_env`: in-process, or remote
when `env.url` is set) and, per row, the one its `agent_ref.name` names (EnvRouter, built once per process
from the section)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gymv.envs.registry import available, env_for_agent, get_env, normalize
from gymv.envs.remote import RemoteEnv
from gymv.envs.rows import agent_name
from gymv.errors import GymvError
from gymv.sections import EnvSection


class EnvRouter:
    """Row -> environment: the configured one, or the built-in/plugin one a row's `agent_ref.name` names.

    Instances are created once per process and reused (environments keep no per-rollout state outside
    their EpisodeState).
    """

    def __init__(self, spec: EnvSection):
        """`spec`: the recipe's `env:` section."""
        self.spec = spec
        try:
            self.default = make_env(spec)
        except GymvError as e:
            raise GymvError(e.message, where=e.where or ("env.url" if spec.url else "env.name"), fix=e.fix) from None
        self._by_agent: dict[str, Any] = {}

    def agent_of(self, row: dict) -> str | None:
        return agent_name(row)

    def __call__(self, row: dict, where: str | None = None):
        """The environment of `row`; an agent that names no installed environment is an error."""
        agent = self.agent_of(row)
        if agent is None or agent == self.default.agent_name or normalize(agent) == self.default.name:
            return self.default
        if agent in self._by_agent:
            return self._by_agent[agent]
        env = env_for_agent(agent)
        if env is None:
            raise GymvError(
                f"agent_ref.name {agent!r} names no environment this run can use (env.name is {self.spec.name!r})",
                where=where, fix=f"use rows of {self.default.agent_name!r}, set env.name to the rows' environment, "
                                 f"or install its plugin (available: {', '.join(available())})")
        self._by_agent[agent] = env
        return env

    def check(self, rows: Sequence[Any]) -> None:
        """Route every row (objects with `.data` and `.where`) once up front, so bad rows fail before any
        worker starts."""
        for r in rows:
            env = self(r.data, r.where)
            env.check_row(r.data, where=r.where)


def make_env(cfg: Any, **overrides: Any) -> Environment:
    """The environment a run's `env:` section describes: in-process, or a `RemoteEnv` when `env.url` is set.

    `cfg` is the validated `env` section (or a dict with the same keys): `name`, `url`, `max_turns`,
    `timeout_s`, `retries`, `kwargs`. `kwargs` go to the environment's constructor (for a remote one:
    `protocol`, `backoff_s`, `agent_name`); `overrides` win over everything.
    """
    def get(key: str, default: Any = None) -> Any:
        return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)

    kwargs = {**(get("kwargs") or {}), **overrides}
    if get("max_turns") is not None:
        kwargs.setdefault("max_turns", get("max_turns"))
    url = get("url")
    if url:
        for key, value in (("timeout_s", get("timeout_s")), ("retries", get("retries"))):
            if value is not None:
                kwargs.setdefault(key, value)
        return RemoteEnv(url, name=get("name"), **kwargs)
    name = get("name")
    if not name:
        raise GymvError("env.name is not set", where="env.name", fix="name an environment (see `gymv env list`)")
    return get_env(name, **kwargs)
