"""Environments: the protocol, the built-ins and the registry (see docs/environments.md)."""

from gymv.envs.protocol import (
    Environment,
    EpisodeState,
    Image,
    Message,
    ModelTurn,
    RowError,
    Score,
    StepResult,
    Text,
    Tool,
    ToolCall,
    ToolCallError,
    ToolOutput,
    ToolResult,
)
from gymv.envs.registry import available, env_for_row, get_env, register
from gymv.envs.routing import make_env

__all__ = [
    "Environment", "EpisodeState", "Image", "Message", "ModelTurn", "RowError", "Score", "StepResult", "Text",
    "Tool", "ToolCall", "ToolCallError", "ToolOutput", "ToolResult", "available", "env_for_row", "get_env",
    "make_env", "register",
]
