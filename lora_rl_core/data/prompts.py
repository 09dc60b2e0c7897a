"""Turning a ``Problem`` into chat messages and prompt token ids.

The user turn is the question, a newline, then the instruction (e.g.
``"Give the final answer after ####."``). Tokenizers without a chat template
(base models) get the same text as plain lines instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lora_rl_core.data.problems import Problem
from lora_rl_core.errors import DataError

if TYPE_CHECKING:
    from lora_rl_core.config import DataConfig, RolloutConfig


def build_messages(problem: Problem, *, system_prompt: str | None, instruction: str) -> list[dict[str, str]]:
    """Return chat messages: an optional system turn, then the problem's turns.

    Args:
        problem: the problem to ask: a text prompt becomes one user turn; a conversational prompt (messages)
            is used as is.
        system_prompt: the system turn's text, or ``None``/``""`` for none; not added where the messages
            start with a system turn of their own.
        instruction: appended after a newline to the (last) user turn; ``""`` for none.

    Returns:
        ``[{"role": "system", "content": ...}?, ..., {"role": "user", "content": question + "\\n" + instruction}]``.
    """
    if isinstance(problem.prompt, str):
        turns = [{"role": "user", "content": problem.prompt}]
    else:
        turns = [dict(m) for m in problem.prompt]
    if instruction:
        last = max((i for i, m in enumerate(turns) if m["role"] == "user"), default=len(turns) - 1)
        turns[last] = {**turns[last], "content": f"{turns[last]['content']}\n{instruction}"}
    if system_prompt and turns[0]["role"] != "system":
        turns.insert(0, {"role": "system", "content": system_prompt})
    return turns


def _as_ids(encoded: Any) -> list[int]:
    """Return the ``input_ids`` of a single encoding as a list of ints.

    Accepts a dict/``BatchEncoding`` or a bare list, batched (``[[...]]``) or not.
    """
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    if ids and isinstance(ids[0], list):
        if len(ids) != 1:
            raise DataError(f"expected one tokenized prompt, got a batch of {len(ids)}")
        ids = ids[0]
    return [int(i) for i in ids]


def render_prompt(tokenizer, problem: Problem, *, system_prompt: str | None, instruction: str) -> list[int]:
    """Tokenize the prompt for ``problem``, ending where the model's answer starts.

    With a chat template: ``apply_chat_template(messages, add_generation_prompt=True)``.
    Without one: the messages' contents, one per line (``"{system}\\n{question}\\n{instruction}\\n"``),
    encoded by ``tokenizer(text)`` with its default special tokens.

    Args:
        tokenizer: a Hugging Face tokenizer (``PreTrainedTokenizerBase``).
        problem: the problem to ask.
        system_prompt: the system turn's text, or ``None``.
        instruction: the answer-format instruction appended to the question.

    Returns:
        The prompt token ids.
    """
    if getattr(tokenizer, "chat_template", None):
        messages = build_messages(problem, system_prompt=system_prompt, instruction=instruction)
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        return _as_ids(encoded)
    lines = [m["content"] for m in build_messages(problem, system_prompt=system_prompt, instruction=instruction)]
    return _as_ids(tokenizer("\n".join(lines) + "\n"))


@dataclass(frozen=True)
class PromptStyle:
    """How a run turns problems into prompt token ids, the one place it is decided (rollouts, the memory
    plan's longest prompt, evaluation).

    Attributes:
        system_prompt: the system turn's text (None: the chat template's default).
        instruction: appended after a newline to the (last) user turn; `""` for none.
    """

    system_prompt: str | None
    instruction: str

    @classmethod
    def of(cls, data: DataConfig, rollout: RolloutConfig) -> PromptStyle:
        """The run's style: `rollout.system_prompt` and the instruction (`rollout.instruction`, else the data
        source's own: `data.load.prompt_instruction`)."""
        from lora_rl_core.data.load import prompt_instruction  # lazy: `load` imports this module

        return cls(rollout.system_prompt, prompt_instruction(data, rollout))

    def render(self, tokenizer: Any, problem: Problem) -> list[int]:
        """`problem`'s prompt token ids in this style (`render_prompt`)."""
        return render_prompt(tokenizer, problem, system_prompt=self.system_prompt, instruction=self.instruction)
