"""Serve one of NeMo Gym's own servers on 127.0.0.1 (run with the Python of a venv that has nemo-gym).

    python serve.py CONFIG_JSON

CONFIG_JSON is {"name": ..., "class": "module:Class", "port": N, "config": {...}, "servers": {name: [host, port]}}.
The server is built and set up as NeMo Gym's own `run_webserver` does it (its FastAPI app, session and
exception middleware, liveness route and request-validation handler), minus the Ray cluster and head server
that `gym env start` adds for launching many servers: the HTTP surface under test is NeMo Gym's.
`servers` names the other servers it calls (an agent's resources and model servers).
"""

import importlib
import json
import sys

import uvicorn
from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from omegaconf import OmegaConf


def main() -> None:
    spec = json.loads(sys.argv[1])
    module_name, class_name = spec["class"].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    servers = {name: {"kind": {"server": {"host": host, "port": port}}} for name, (host, port) in spec.get("servers", {}).items()}
    global_config = OmegaConf.create({"head_server": {"host": "127.0.0.1", "port": 1}, **servers})

    from nemo_gym import global_config as gc
    from nemo_gym.server_utils import BaseServerConfig, ServerClient

    gc._GLOBAL_CONFIG_DICT = global_config
    config_cls = cls.model_fields["config"].annotation
    config = config_cls.model_validate({"host": "127.0.0.1", "port": spec["port"], "entrypoint": "app.py",
                                        "name": spec["name"], **spec.get("config", {})})
    client = ServerClient(head_server_config=BaseServerConfig(host="127.0.0.1", port=1), global_config_dict=global_config)
    server = cls(config=config, server_client=client)
    app = server.setup_webserver()
    server.setup_liveness(app)
    server.setup_exception_middleware(app)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc):
        return await request_validation_exception_handler(request, exc)

    uvicorn.run(app, host="127.0.0.1", port=spec["port"], log_level="warning", timeout_graceful_shutdown=1)


if __name__ == "__main__":
    main()
