"""A scripted model server on NeMo Gym's own model-server stack (run with the nemo-gym venv's Python, by serve.py).

`ScriptedResponsesModel` is a NeMo Gym `SimpleResponsesAPIModel` (its FastAPI app, session middleware and
request validation) whose `responses()` answers every request with one fixed assistant message instead of
calling a model: the peer of gymv's policy server in the HTTP benchmark, where what is measured is the
server around the model, not the model.
"""

import time
import uuid

from fastapi import Body
from nemo_gym.base_responses_api_model import BaseResponsesAPIModelConfig, SimpleResponsesAPIModel
from nemo_gym.openai_utils import NeMoGymResponse, NeMoGymResponseCreateParamsNonStreaming


class ScriptedResponsesModelConfig(BaseResponsesAPIModelConfig):
    reply: str = "\\boxed{3}"


class ScriptedResponsesModel(SimpleResponsesAPIModel):
    config: ScriptedResponsesModelConfig

    async def responses(self, body: NeMoGymResponseCreateParamsNonStreaming = Body()) -> NeMoGymResponse:
        message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": self.config.reply, "annotations": []}]}
        return NeMoGymResponse(id=f"resp_{uuid.uuid4().hex}", created_at=float(int(time.time())), model="scripted",
                               object="response", output=[message], parallel_tool_calls=True, tool_choice="auto",
                               tools=[])

    async def chat_completions(self, body: dict = Body()):
        raise NotImplementedError("the benchmark calls /v1/responses only")
