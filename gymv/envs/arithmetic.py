"""arithmetic: a text-only task (no image anywhere) with a checkable integer answer in `\\boxed{}`.

It exists so that a dataset can mix rows that carry images with rows that carry none: multi-teacher
distillation then routes image rows to an image teacher and these rows to a text-only teacher, and every
batching path meets rows without images beside rows with them.

Reward: the first `\\boxed{<integer>}` (an optional minus sign, then digits) in the concatenated assistant
text equals `expected_answer` -> 1.0, else 0.0. The row keeps the `expression` it asks about; the answer is
computed with the usual precedence (`*` before `+` and `-`, left to right otherwise).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from gymv.envs import sampling
from gymv.envs.knobs import knob
from gymv.envs.protocol import Environment, ModelTurn, RowError, Score
from gymv.envs.rows import answer_int, output_text
from gymv.errors import GymvError

DEFAULT_SYSTEM_PROMPT = (
    "Work out the value of the expression the user gives you. Finish with the result as a whole number "
    "inside \\boxed{}, for example \\boxed{12}."
)
DEFAULT_QUESTION = "What is {expression}?"
OPERATORS = ("+", "-", "*")
BOXED = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}")


@dataclass(frozen=True)
class ArithmeticKnobs:
    operands: tuple[int, int] = knob((0, 99), "value of each operand, lo:hi (non-negative)")
    terms: tuple[int, int] = knob((2, 3), "operands per expression, lo:hi")
    ops: tuple[str, ...] = knob(OPERATORS, "operators to draw from (+, -, *)")
    system_prompt: str = knob(DEFAULT_SYSTEM_PROMPT, "system message ('' for none)")
    question: str = knob(DEFAULT_QUESTION, "user question; {expression} is the expression")


TINY = ArithmeticKnobs(operands=(0, 9), terms=(2, 2), ops=("+",), system_prompt="", question="{expression}=?")


def evaluate(tokens: list) -> int:
    """Value of [a, op, b, op, c, ...] with `*` binding tighter than `+`/`-`."""
    sums: list[int] = [tokens[0]]
    signs: list[int] = [1]
    for op, value in zip(tokens[1::2], tokens[2::2]):
        if op == "*":
            sums[-1] *= value
        else:
            sums.append(value)
            signs.append(1 if op == "+" else -1)
    return sum(s * v for s, v in zip(signs, sums))


class Arithmetic(Environment):
    name = "arithmetic"
    agent_name = "arithmetic_simple_agent"
    description = "evaluate an integer expression (text only); answer \\boxed{N}"
    verifier_fields = ("expression", "expected_answer")
    Knobs = ArithmeticKnobs
    presets = {"default": ArithmeticKnobs(), "tiny": TINY}

    def check_knobs(self, knobs: ArithmeticKnobs) -> None:
        lo, hi = knobs.operands
        if lo < 0:
            raise GymvError(f"{self.name}: operands {lo}:{hi} must be non-negative", fix="use operands=0:99")
        if knobs.terms[0] < 2:
            raise GymvError(f"{self.name}: terms {knobs.terms[0]}:{knobs.terms[1]} must start at 2 or more",
                            fix="use terms=2:3")
        bad = [op for op in knobs.ops if op not in OPERATORS]
        if bad:
            raise GymvError(f"{self.name}: unknown operator(s) {', '.join(bad)}", fix="use ops from +,-,*")
        if "{expression}" not in knobs.question:
            raise GymvError(f"{self.name}: the question must contain {{expression}}", fix="e.g. question='What is {expression}?'")

    def make_row(self, rng: random.Random, knobs: ArithmeticKnobs, index: int) -> dict:
        n = sampling.randint(rng, *knobs.terms)
        tokens: list = [sampling.randint(rng, *knobs.operands)]
        for _ in range(n - 1):
            tokens += [sampling.choice(rng, knobs.ops), sampling.randint(rng, *knobs.operands)]
        expression = " ".join(str(t) for t in tokens)
        messages: list[dict] = []
        if knobs.system_prompt:
            messages.append({"role": "system", "content": knobs.system_prompt})
        messages.append({"role": "user", "content": knobs.question.replace("{expression}", expression)})
        return {
            "responses_create_params": {"input": messages},
            "expression": expression,
            "expected_answer": evaluate(tokens),
            "agent_ref": {"type": "responses_api_agents", "name": self.agent_name},
        }

    def check_row(self, row: object, *, where: str | None = None) -> dict:
        super().check_row(row, where=where)
        answer = row["expected_answer"]  # type: ignore[index]
        if isinstance(answer, bool) or not isinstance(answer, int):
            raise RowError(f"expected_answer must be an integer, got {answer!r}", where=where,
                           fix="generate rows with `gymv prepare arithmetic`")
        if not isinstance(row["expression"], str):  # type: ignore[index]
            raise RowError("expression must be a string", where=where, fix="generate rows with `gymv prepare arithmetic`")
        return row  # type: ignore[return-value]

    def score_output(self, row: dict, output: list[dict]) -> Score:
        self.check_row(row)
        expected = row["expected_answer"]
        match = BOXED.search(output_text(output))
        predicted = answer_int(match.group(1)) if match else None  # None: too long to be any answer
        correct = predicted is not None and predicted == expected
        reason = None if correct else ("no_boxed_answer" if match is None else "wrong_answer")
        return Score(1.0 if correct else 0.0, {"predicted_answer": predicted, "correct": correct}, reason)

    def gold_turn(self, row: dict) -> ModelTurn:
        return ModelTurn(text=f"\\boxed{{{row['expected_answer']}}}")
