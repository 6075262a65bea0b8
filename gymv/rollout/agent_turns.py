"""Episodes that an outside agent drives: rebuild the token sequence from a conversation, turn by turn.

When a NeMo Gym agent runs the episode, gymv sees it twice: as requests to its model server (the whole
conversation so far, each call) and as the agent's final result (the whole transcript). Both carry, on the
last output item of every model call, the exact `prompt_token_ids`, `generation_token_ids` and
`generation_log_probs` gymv's model server produced. Walking the items in order, the sequence grows exactly as
gymv's own agent loop grows it: sampled tokens kept as sampled, and only what the environment added between
two model calls (tool outputs, user messages) rendered and tokenized — with the same renderer, so the tokens
are the ones the loop would have made. A model call whose prompt does not extend the sequence so far is an
error naming the row and turn, never a silently re-tokenized sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gymv.envs.protocol import Image, Message, RowError, Text, ToolResult
from gymv.envs.responses import decode_parts
from gymv.envs.rows import parse_message, to_chat_tool
from gymv.rollout.episode import Episode
from gymv.rollout.images import ImageCache
from gymv.rollout.render import ChatRenderer, message_dict, tool_message_dict
from gymv.rollout.types import Trajectory

TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
_MODEL_TYPES = ("function_call", "reasoning")


def is_model_item(item: Any) -> bool:
    if not isinstance(item, dict):
        return False
    kind = item.get("type", "message")
    return kind in _MODEL_TYPES or (kind == "message" and item.get("role") == "assistant")


def _content_parts(content: Any) -> list:
    content = decode_parts(content)
    if isinstance(content, str):
        return [Text(content)]
    parts: list = []
    for p in content if isinstance(content, list) else []:
        if isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text"):
            parts.append(Text(str(p.get("text", ""))))
        elif isinstance(p, dict) and p.get("type") == "input_image" and isinstance(p.get("image_url"), str):
            parts.append(Image(p["image_url"], p.get("detail") or "auto"))
    return parts


def added_message(item: dict, names: dict[str, str]) -> tuple[dict, list[Image]]:
    """One item the environment (or the agent) added after a model call, as a chat-template message."""
    if item.get("type") == "function_call_output":
        parts = _content_parts(item.get("output", ""))
        text = "".join(p.text for p in parts if isinstance(p, Text))
        call_id = str(item.get("call_id", ""))
        return tool_message_dict(ToolResult(call_id, names.get(call_id, ""), text,
                                            [p for p in parts if isinstance(p, Image)]))
    role = item.get("role", "user")
    return message_dict(Message(role if role in ("user", "system", "developer") else "user",
                                _content_parts(item.get("content", ""))))


@dataclass
class Rebuilt:
    """A sequence rebuilt from a conversation: tokens, mask, logprobs, images with their turns, model calls."""

    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    images: list[Any] = field(default_factory=list)
    image_turns: list[int] = field(default_factory=list)
    image_keys: list[str] = field(default_factory=list)
    model_calls: list[dict] = field(default_factory=list)
    last_generated: list[int] = field(default_factory=list)

    insert = Episode.append_inserted  # the loop's own bookkeeping of inserted tokens and their images


class TurnRebuilder:
    """Renders what a conversation adds between model calls with the policy's own renderer and adapter."""

    def __init__(self, renderer: ChatRenderer, adapter, cache: ImageCache | None = None):
        self.renderer, self.adapter = renderer, adapter
        self.cache = cache or ImageCache()

    def _decode(self, images: list[Image], where: str) -> list[tuple[Any, str]]:
        return [self.cache.get(im, where=where) for im in images]

    def prompt(self, seq: Rebuilt, items: list, tools: list[dict] | None, where: str) -> None:
        messages = [parse_message(i, f"input[{k}]", where=where) for k, i in enumerate(items)]
        text, images = self.renderer.prompt(messages, tools)
        decoded = self._decode(images, where)
        seq.insert(self.adapter.encode_text(text, [p for p, _ in decoded], where=where), decoded, 0)

    def addition(self, seq: Rebuilt, items: list, names: dict[str, str], turn: int, where: str) -> None:
        added = [added_message(i, names) for i in items]
        text, images = self.renderer.addition(added, turn_closed=self.renderer.ends_turn(seq.last_generated))
        decoded = self._decode(images, where)
        seq.insert(self.adapter.encode_text(text, [p for p, _ in decoded], where=where), decoded, turn)

    def rebuild(self, items: list, tools: list[dict] | None, *, where: str,
                check_prompts: bool = True) -> tuple[Rebuilt, list]:
        """The sequence of every complete model call in `items`, and the items after the last one.

        With `check_prompts`, each model call's recorded `prompt_token_ids` must equal the rebuilt sequence
        (the call was made on exactly the tokens gymv's loop would have made)."""
        seq = Rebuilt()
        names: dict[str, str] = {}
        first_call = next((k for k, i in enumerate(items) if is_model_item(i)), len(items))
        self.prompt(seq, items[:first_call], tools, where)
        pending: list = []
        for k in range(first_call, len(items)):
            item = items[k]
            turn = len(seq.model_calls)
            if not isinstance(item, dict):
                raise RowError(f"item {k} of the conversation is not an object", where=where,
                               fix="check the agent server: every conversation item must be an object")
            if item.get("type") == "function_call":
                names[str(item.get("call_id", ""))] = str(item.get("name", ""))
            if not is_model_item(item):
                pending.append(item)
                continue
            if pending:  # what came between two model calls: rendered as the loop renders it
                self.addition(seq, pending, names, turn, f"{where}, turn {turn}")
                pending = []
            if TOKEN_FIELDS[0] not in item:
                continue  # an earlier item of a model call; its tokens ride on the call's last item
            missing = [f for f in TOKEN_FIELDS if f not in item]
            if missing:
                raise RowError(f"item {k} has only some of the token fields (missing {missing})",
                               where=f"{where}, turn {turn}", fix="serve the policy with gymv's model server")
            prompt, gen, lps = (list(item[f]) for f in TOKEN_FIELDS)
            if check_prompts and prompt != seq.ids:
                at = next((n for n, (a, b) in enumerate(zip(prompt, seq.ids)) if a != b), min(len(prompt), len(seq.ids)))
                raise RowError(f"the model call's prompt tokens do not extend the episode's tokens (they differ at "
                               f"token {at}; {len(prompt)} recorded, {len(seq.ids)} rebuilt)",
                               where=f"{where}, turn {turn}",
                               fix="the agent changed the conversation between calls; such an episode cannot be "
                                   "trained token-in/token-out")
            if len(gen) != len(lps):
                raise RowError(f"{len(gen)} generated tokens but {len(lps)} logprobs", where=f"{where}, turn {turn}",
                               fix="check the model server: each generated token needs one logprob")
            start = len(seq.ids)
            seq.ids.extend(gen)
            seq.mask.extend([1] * len(gen))
            seq.logprobs.extend(float(x) for x in lps)
            seq.last_generated = gen
            seq.model_calls.append({"turn": turn, "prompt_end": start, "generation_start": start,
                                    "generation_end": len(seq.ids), "finish_reason": "stop", "stop_reason": None,
                                    "output_index": k})
        return seq, pending

    def request_prompt(self, items: list, tools: list[dict] | None, *, where: str) -> Rebuilt:
        """The prompt of the next model call of a conversation (what the model server generates from)."""
        seq, pending = self.rebuild(items, tools, where=where)
        if seq.model_calls:
            names = {str(i.get("call_id", "")): str(i.get("name", "")) for i in items
                     if isinstance(i, dict) and i.get("type") == "function_call"}
            self.addition(seq, pending, names, len(seq.model_calls), f"{where}, turn {len(seq.model_calls)}")
        return seq


def chat_tools(tools: Any) -> list[dict] | None:
    return [to_chat_tool(t) for t in tools if isinstance(t, dict)] or None if isinstance(tools, list) else None


def trajectory_from_result(result: dict, row: dict, rebuilder: TurnRebuilder, *, task_index: int, sample_index: int,
                           agent_name: str, where: str, weights_version: int = 0) -> Trajectory:
    """The training sample of one agent `/run` result: its tokens spliced call by call, its reward."""
    response = result.get("response")
    if not isinstance(response, dict) or not isinstance(response.get("output"), list):
        raise RowError("the agent's result has no response.output", where=where,
                       fix="check the agent server: its /run result must hold the response")
    params = row.get("responses_create_params") or {}
    prompt_items = params.get("input", [])
    if isinstance(prompt_items, str):
        prompt_items = [{"role": "user", "content": prompt_items}]
    output = response["output"]
    seq, _ = rebuilder.rebuild(list(prompt_items) + list(output), chat_tools(params.get("tools")), where=where)
    if not seq.model_calls:
        raise RowError("the agent's result holds no model call with token ids", where=where,
                       fix="point the agent's model server at gymv's (it returns the token fields)")
    offset = len(prompt_items)
    calls = [dict(c, output_index=c["output_index"] - offset) for c in seq.model_calls]
    reward = result.get("reward")
    if not isinstance(reward, (int, float)) or isinstance(reward, bool):
        raise RowError(f"the agent's result has no numeric reward ({reward!r})", where=where,
                       fix="check the agent server: its /run result must hold the reward its verifier gave")
    extras = {k: v for k, v in result.items() if k not in row and k not in ("response", "reward")}
    return Trajectory(row=row, task_index=task_index, sample_index=sample_index, agent_name=agent_name,
                      token_ids=seq.ids, loss_mask=seq.mask, logprobs=seq.logprobs, images=seq.images,
                      image_turns=seq.image_turns, image_keys=seq.image_keys, output=list(output),
                      model_calls=calls, reward=float(reward), extras=extras, turns=len(calls),
                      truncated=bool(result.get("truncated", False)), weights_version=weights_version)
