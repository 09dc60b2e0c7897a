"""Every field of every config section has an attribute docstring, which pydantic makes its description.

`Section` sets `use_attribute_docstrings=True`, so the `\"\"\"...\"\"\"` line after a field becomes
`FieldInfo.description` (and the JSON schema's `description`, for tooling). A field added without one fails
here, naming it.
"""

from __future__ import annotations

import inspect

import pytest
from pydantic import BaseModel

from lora_rl_core import config

SECTIONS = sorted(
    (obj for obj in vars(config).values() if inspect.isclass(obj) and issubclass(obj, config.Section)),
    key=lambda cls: cls.__name__,
)


def test_sections_are_found():
    names = {cls.__name__ for cls in SECTIONS}
    assert {"RunConfig", "RolloutConfig", "TrainerConfig", "RewardFunctionConfig"} <= names


@pytest.mark.parametrize("section", SECTIONS, ids=lambda cls: cls.__name__)
def test_every_field_has_a_docstring(section: type[BaseModel]):
    missing = [name for name, info in section.model_fields.items() if not (info.description or "").strip()]
    assert not missing, f"{section.__name__}: fields without an attribute docstring: {missing}"


def test_descriptions_reach_the_json_schema():
    schema = config.RunConfig.model_json_schema()
    rollout = schema["$defs"]["RolloutConfig"]["properties"]
    assert rollout["temperature"]["description"].startswith("Sampling temperature")
    assert schema["properties"]["rollout"]["description"]
