"""Turn messages into the text the chat template makes of them, one turn's worth at a time.

The agent loop never re-renders the conversation: it renders the prompt once, then only the messages each
turn adds. To get "only the new messages" right for any template (ones that insert a default system
prompt, or put a newline after the end-of-turn token), the new messages are rendered after a fixed
two-message stand-in conversation that ends with an assistant turn, and the stand-in's own rendering is
cut off. What the template writes after the assistant's end-of-turn token (the glue) is learned once from
the same stand-in, so the text appended after a sampled end-of-turn token is exactly what the template
would have written there.
"""

from __future__ import annotations

import json
from typing import Any

from gymv.envs.protocol import Image, Message, ModelTurn, Part, Text, ToolResult
from gymv.errors import GymvError
from gymv.rollout.parse import parse_turn
from gymv.rollout.tool_formats import get_tool_call_format

_SENTINEL = "@@gymv-assistant-turn@@"
_STAND_IN = [{"role": "user", "content": "."}, {"role": "assistant", "content": _SENTINEL}]


def template_content(parts: list[Part]) -> str | list[dict]:
    """Content parts in the form chat templates take: a plain string, or text and image parts."""
    if len(parts) == 1 and isinstance(parts[0], Text):
        return parts[0].text
    return [{"type": "text", "text": p.text} if isinstance(p, Text) else {"type": "image"} for p in parts]


def message_dict(message: Message) -> tuple[dict, list[Image]]:
    return {"role": message.role, "content": template_content(message.content)}, message.images


def tool_message_dict(result: ToolResult) -> tuple[dict, list[Image]]:
    parts: list[Part] = ([Text(result.text)] if result.text or not result.images else []) + list(result.images)
    return ({"role": "tool", "tool_call_id": result.call_id, "name": result.name,
             "content": template_content(parts)}, list(result.images))


def assistant_dict(turn: ModelTurn) -> dict:
    """A model turn as a chat-template assistant message (OpenAI tool_calls shape; arguments as objects).

    Reasoning goes into the content as a `<think>` block, the form the loop's parser reads back."""
    calls = []
    for c in turn.tool_calls:
        try:
            args: Any = json.loads(c.arguments)
        except (json.JSONDecodeError, TypeError):
            args = c.arguments
        calls.append({"type": "function", "id": c.call_id, "function": {"name": c.name, "arguments": args}})
    content = f"<think>{turn.reasoning}</think>{turn.text}" if turn.reasoning else turn.text
    out: dict = {"role": "assistant", "content": content}
    if calls:
        out["tool_calls"] = calls
    return out


def _args(arguments: Any) -> Any:
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except (json.JSONDecodeError, TypeError):
        return arguments


_RESERVED_KWARGS = ("messages", "tools", "tokenize", "add_generation_prompt", "chat_template", "conversation",
                    "continue_final_message", "return_dict")


class ChatRenderer:
    """Renders prompts, per-turn additions and gold assistant turns with one tokenizer's chat template.

    `template_kwargs` (e.g. `{"enable_thinking": False}`) go into every rendering, so the prompt, each
    turn's addition and an SFT sample's assistant turns all see the same template variables.
    """

    def __init__(self, tokenizer, chat_template: str | None, template_kwargs: dict | None = None, *,
                 tool_call_format=None):
        self.tool_call_format = get_tool_call_format(tool_call_format)
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.template_kwargs = dict(template_kwargs or {})
        reserved = sorted(set(self.template_kwargs) & set(_RESERVED_KWARGS))
        if reserved:
            raise GymvError(f"chat-template kwargs may not set {', '.join(reserved)}: the agent loop sets them",
                            fix="pass only the template's own variables (e.g. enable_thinking)")
        eos = tokenizer.eos_token
        if not eos:
            raise GymvError("the tokenizer has no eos_token, so the end of a model turn is unknown",
                            fix="set eos_token (the chat template's end-of-turn token) in tokenizer_config.json")
        self.turn_end = eos
        self.turn_end_ids = tokenizer.encode(eos, add_special_tokens=False)
        self._stand_in = self.render(_STAND_IN)
        tail = self._stand_in[self._stand_in.rindex(_SENTINEL) + len(_SENTINEL):]
        if not tail.startswith(eos):
            raise GymvError(f"the chat template does not end an assistant turn with the eos token {eos!r} "
                            f"(it writes {tail!r} after the content)",
                            fix="use a chat template whose assistant turns end with the tokenizer's eos_token")
        self.glue = tail[len(eos):]
        self._declared: dict[str, bool] = {}  # tools (JSON) -> whether the template declares them in the format

    def render(self, messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      chat_template=self.chat_template, **self.template_kwargs)
        except GymvError:
            raise
        except Exception as e:  # jinja errors: unsupported role or part type, template bugs
            raise GymvError(f"the chat template failed to render: {type(e).__name__}: {e}",
                            fix="check the messages' roles and content types against the model's template") from None

    def declare(self, dicts: list[dict], tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
        """(messages, tools) to render. Where the tool-call format writes declarations of its own and the
        chat template declares the tools in another form (the tiny models' templates write Hermes
        declarations), the format's declarations end the system message (one is added when the prompt has
        none) and the template gets no tools; otherwise they pass unchanged."""
        if not tools:
            return dicts, tools
        block = self.tool_call_format.write_tools(tools)
        if block is None:
            return dicts, tools
        key = json.dumps(tools, sort_keys=True, default=str)
        if key not in self._declared:
            self._declared[key] = self.tool_call_format.declares(self.render(_STAND_IN[:1], tools=tools), tools)
        if self._declared[key]:
            return dicts, tools
        if dicts and dicts[0].get("role") == "system":
            content = dicts[0].get("content")
            if isinstance(content, list):
                content = content + [{"type": "text", "text": "\n\n" + block}]
            else:
                content = f"{content}\n\n{block}" if content else block
            return [{**dicts[0], "content": content}] + list(dicts[1:]), None
        return [{"role": "system", "content": block}] + list(dicts), None

    def prompt(self, messages: list[Message], tools: list[dict] | None) -> tuple[str, list[Image]]:
        """The first turn: every message of the prompt, the tool schemas, and the generation prompt."""
        dicts, images = zip(*(message_dict(m) for m in messages)) if messages else ((), ())
        dicts, tools = self.declare(list(dicts), tools)
        return (self.render(dicts, tools=tools, add_generation_prompt=True),
                [im for ims in images for im in ims])

    def addition(self, added: list[tuple[dict, list[Image]]], *, turn_closed: bool) -> tuple[str, list[Image]]:
        """Text that follows a sampled model turn: its end-of-turn (if the model stopped without one), the
        template's glue, the new messages and the generation prompt; with the images of those messages."""
        dicts = [d for d, _ in added]
        full = self.render(_STAND_IN + dicts, add_generation_prompt=True)
        if not full.startswith(self._stand_in):
            raise GymvError("the chat template is not prefix-stable: rendering more messages changed the text "
                            "of the earlier ones", fix="use a chat template that renders each message on its own")
        text = ("" if turn_closed else self.turn_end) + self.glue + full[len(self._stand_in):]
        return text, [im for _, ims in added for im in ims]

    def assistant(self, conversation: list[dict], tools: list[dict] | None, turn: ModelTurn) -> str:
        """The text of an assistant turn after the conversation so far (message dicts), ending with the
        end-of-turn token: what a model that says `turn` samples after the generation prompt.

        The template renders the turn's tool calls where it writes them in the recipe's tool-call format (the
        text parses back to the same calls); where it writes another form, or none, the calls are written
        into the content in that format, so that what SFT teaches is what the rollout parser reads."""
        dicts, schemas = self.declare(list(conversation), tools)
        prompt = self.render(dicts, tools=schemas, add_generation_prompt=True)
        text = self._assistant_text(dicts, schemas, prompt, assistant_dict(turn))
        if turn.tool_calls and not self._same_calls(text, turn, tools):
            text = self._assistant_text(dicts, schemas, prompt, self._calls_in_content(turn))
        return text

    def _same_calls(self, text: str, turn: ModelTurn, tools: list[dict] | None) -> bool:
        """The rendered turn reads back, in the recipe's format, as the same calls and the same visible text."""
        body = text[:-len(self.turn_end)] if text.endswith(self.turn_end) else text
        got = parse_turn(body, "call", self.tool_call_format, tools)
        return ([(c.name, _args(c.arguments)) for c in got.tool_calls]
                == [(c.name, _args(c.arguments)) for c in turn.tool_calls] and got.text.strip() == turn.text.strip())

    def _calls_in_content(self, turn: ModelTurn) -> dict:
        content = assistant_dict(ModelTurn(text=turn.text, reasoning=turn.reasoning))["content"]
        calls = [(c.name, _args(c.arguments)) for c in turn.tool_calls]
        return {"role": "assistant", "content": self.tool_call_format.write_turn(content, calls)}

    def _assistant_text(self, dicts: list[dict], tools, prompt: str, message: dict) -> str:
        full = self.render(dicts + [message], tools=tools)
        if not full.startswith(prompt):
            raise GymvError("the chat template renders an assistant turn that does not start with its own "
                            "generation prompt", fix="use a chat template whose generation prompt opens assistant turns")
        text = full[len(prompt):]
        if self.glue and text.endswith(self.glue):
            text = text[:-len(self.glue)]
        if not text.endswith(self.turn_end):
            raise GymvError(f"the chat template's assistant turn does not end with {self.turn_end!r}",
                            fix="use a chat template whose assistant turns end with the tokenizer's eos_token")
        return text

    def ends_turn(self, token_ids: list[int]) -> bool:
        n = len(self.turn_end_ids)
        return n > 0 and token_ids[-n:] == self.turn_end_ids
