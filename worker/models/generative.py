"""A generative handler as the rest of the worker sees a model: ``input_type`` and ``decode`` for intake,
the request limits of ``model.generation``, and the handler's ``step_model()`` for the generation worker.

``decode`` runs on the loop thread and only validates: tokenizing belongs to the device thread, which owns
the step model (``worker.pipeline.generation``).
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

from worker.config.settings import GenerationConfig
from worker.core.step_model import GenerativeHandler, GenParams, StepModel
from worker.models.inputs import GenerateInput, GenerationOutput


class GenerationRequestError(ValueError):
    """A request over a configured limit; the message names the field path."""


class GenRequest(NamedTuple):
    prompt: str
    params: GenParams


def is_generative(model: Any) -> bool:
    return getattr(model, "kind", None) == "generative"


class GenerativeModel:
    kind: ClassVar[str] = "generative"
    input_type: ClassVar[Any] = GenerateInput
    output_type: ClassVar[Any] = GenerationOutput
    uses_torch: ClassVar[bool] = False  # the generation worker, not the torch engine, runs it

    def __init__(self, handler: GenerativeHandler, limits: GenerationConfig) -> None:
        self.handler = handler
        self.limits = limits
        self.name = str(handler.name)
        self.version = str(handler.version)

    def setup(self, device: str) -> None:
        self.handler.setup(device)

    def step_model(self) -> StepModel:
        return self.handler.step_model()

    def decode(self, inputs: GenerateInput) -> GenRequest:
        lim = self.limits
        if len(inputs.prompt) > lim.max_prompt_chars:
            raise GenerationRequestError(f"$.inputs.prompt: {len(inputs.prompt)} characters, over "
                                         f"model.generation.max_prompt_chars={lim.max_prompt_chars}")
        n = inputs.max_new_tokens
        if n is None:
            n = min(lim.default_max_new_tokens, lim.max_new_tokens)
        elif n > lim.max_new_tokens:
            raise GenerationRequestError(f"$.inputs.max_new_tokens: {n}, over "
                                         f"model.generation.max_new_tokens={lim.max_new_tokens}")
        if len(inputs.stop) > lim.max_stop:
            raise GenerationRequestError(f"$.inputs.stop: {len(inputs.stop)} stop strings, over "
                                         f"model.generation.max_stop={lim.max_stop}")
        for i, s in enumerate(inputs.stop):
            if len(s) > lim.max_stop_chars:
                raise GenerationRequestError(f"$.inputs.stop[{i}]: {len(s)} characters, over "
                                             f"model.generation.max_stop_chars={lim.max_stop_chars}")
        return GenRequest(inputs.prompt, GenParams(max_new_tokens=n, temperature=inputs.temperature,
                                                   top_p=inputs.top_p, seed=inputs.seed,
                                                   stop=tuple(inputs.stop)))

    def size_of(self, item: GenRequest) -> int:
        return len(item.prompt) + item.params.max_new_tokens

    def example_inputs(self) -> list[dict[str, Any]]:
        return [{"prompt": "Summarise: the worker batches events.", "max_new_tokens": 8},
                {"prompt": "Label this event", "max_new_tokens": 4, "stop": ["."]}]
