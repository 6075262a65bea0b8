"""The text a tiny model's tokenizer is trained on.

A random policy still has to produce tokens that the environments can parse, so the vocabulary covers what
the built-in tasks speak: digits and numbers, `\\boxed{}` answers, color and shape words, coordinates,
JSON tool calls and tool schemas, and chat-template markers. The lines are drawn from `random.Random(seed)`,
so one seed always yields the same corpus (and therefore the same tokenizer).
"""

from __future__ import annotations

import json
import random

COLORS = ["red", "green", "blue", "yellow", "orange", "purple", "pink", "cyan", "magenta", "black", "white",
          "gray", "brown", "teal", "navy", "lime"]
SHAPES = ["circle", "circles", "square", "squares", "triangle", "triangles", "rectangle", "star", "dot", "disk",
          "shape", "shapes", "object", "objects"]
WORDS = ["the", "a", "an", "of", "in", "on", "at", "is", "are", "there", "how", "many", "count", "answer",
         "image", "picture", "please", "think", "step", "by", "final", "put", "your", "inside", "click", "center",
         "target", "color", "number", "total", "I", "see", "so", "then", "first", "next", "tool", "call", "result",
         "position", "coordinates", "pixel", "left", "right", "top", "bottom", "hit", "miss", "correct", "wrong",
         "which", "what", "where", "find", "look", "carefully", "and", "or", "not", "with", "for", "to", "it",
         "this", "that", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
TOOLS = {
    "click": {"x": "integer", "y": "integer"},
    "zoom": {"x": "integer", "y": "integer", "scale": "number"},
    "crop": {"left": "integer", "top": "integer", "right": "integer", "bottom": "integer"},
    "answer": {"text": "string"},
    "count": {"color": "string"},
}
SPECIAL_TEXT = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>", "</tools>"]


def _sentence(rng: random.Random) -> str:
    color, shape = rng.choice(COLORS), rng.choice(SHAPES)
    n = rng.randint(0, 30)
    templates = [
        f"How many {color} {shape} are in the image? Put the final answer inside \\boxed{{}}.",
        f"I count {n} {color} {shape}, so the answer is \\boxed{{{n}}}.",
        f"There are {n} {shape} and {rng.randint(0, 9)} of them are {color}.",
        f"Click the center of the {color} {shape}.",
        f"The {color} {shape} is at ({rng.randint(0, 999)}, {rng.randint(0, 999)}).",
        f"\\boxed{{{n}}}",
        f"The answer is {rng.randint(0, 100000)}.",
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) + rng.choice([".", "?", "!", ","]),
    ]
    return rng.choice(templates)


def _tool_call(rng: random.Random) -> str:
    name = rng.choice(sorted(TOOLS))
    args = {}
    for key, kind in TOOLS[name].items():
        args[key] = (rng.randint(0, 999) if kind == "integer" else round(rng.uniform(0.5, 4.0), 2) if kind == "number"
                     else rng.choice(COLORS + WORDS))
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


def _tool_schema(rng: random.Random) -> str:
    name = rng.choice(sorted(TOOLS))
    props = {k: {"type": v, "description": f"the {k} value"} for k, v in TOOLS[name].items()}
    schema = {"type": "function", "function": {"name": name, "description": f"{name} on the image",
              "parameters": {"type": "object", "properties": props, "required": sorted(props)}}}
    return json.dumps(schema)


def _chat(rng: random.Random) -> str:
    return "".join([
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>",
        f"<|im_start|>user\n{_sentence(rng)}<|im_end|>",
        f"<|im_start|>assistant\n{_sentence(rng)}{_tool_call(rng) if rng.random() < 0.5 else ''}<|im_end|>",
        f"<|im_start|>tool\n<tool_response>{rng.choice(['hit', 'miss', 'ok', str(rng.randint(0, 99))])}</tool_response><|im_end|>",
    ])


def build_corpus(seed: int, lines: int = 3000) -> list[str]:
    """Deterministic training text for the tiny tokenizer (same seed, same lines)."""
    rng = random.Random(seed)
    out = [" ".join(str(i) for i in range(0, 1000, 7)), " ".join(COLORS + SHAPES + WORDS), " ".join(SPECIAL_TEXT)]
    makers = [_sentence, _sentence, _sentence, _tool_call, _tool_schema, _chat]
    for _ in range(lines):
        out.append(rng.choice(makers)(rng))
    return out
