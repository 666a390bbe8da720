"""User options of the plugin, read from ``additional_config["easyspec"]``.

Invariant: a config object that exists is valid on its own (field types, ranges, no unknown keys);
checks that need the draft model (its layer count, the TP size) live in :func:`resolve_layer_groups`
of :mod:`vllm_easyspec.easyspec.layer_grouping`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vllm_easyspec.tree.config import AutoSpeculation, PromptLookupSource, TreeConfig, TreeSources

ADDITIONAL_CONFIG_KEY = "easyspec"


class EasySpecConfigError(ValueError):
    """An invalid ``additional_config["easyspec"]`` option; the message names the field and the fix."""


class EasySpecConfig(BaseModel):
    """Options of the EasySpec draft-model proposer.

    ``layer_parallel_size`` N groups the draft's attention layers (first and last excluded) into sets of N
    that read one shared hidden state; N = 1 is exact drafting. ``layer_groups`` overrides the default
    grouping with explicit layer indices. ``calibration`` chooses when the first draft forward of a step
    runs exact; ``mode`` chooses how a group's attention runs. ``tree`` turns on token-tree speculation
    (:class:`~vllm_easyspec.tree.config.TreeConfig`); without it the drafter proposes a chain.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    layer_parallel_size: int = Field(default=1, ge=1)
    layer_groups: tuple[tuple[int, ...], ...] | None = None
    calibration: Literal["every_round", "on_mismatch", "never"] = "every_round"
    mode: Literal["auto", "fused", "tensor_parallel"] = "auto"
    tree: TreeConfig | None = None

    @property
    def is_fuzzy(self) -> bool:
        return self.layer_parallel_size > 1 or bool(self.layer_groups)


def parse_easyspec_config(additional_config: dict[str, Any] | None) -> EasySpecConfig | None:
    """Return the validated options, or None when the user did not ask for the plugin."""
    if not additional_config or ADDITIONAL_CONFIG_KEY not in additional_config:
        return None
    raw = additional_config[ADDITIONAL_CONFIG_KEY]
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise EasySpecConfigError(f'additional_config["{ADDITIONAL_CONFIG_KEY}"] must be a JSON object such '
                                  f'as {{"layer_parallel_size": 2}}, got {type(raw).__name__}')
    try:
        return EasySpecConfig.model_validate(raw)
    except ValidationError as exc:
        raise EasySpecConfigError(_describe_validation_error(exc)) from None


# option groups by the path that leads to them, longest first: an unknown key is reported with its group's options
_OPTION_GROUPS: tuple[tuple[str, type[BaseModel]], ...] = (
    ("tree.sources.prompt_lookup.", PromptLookupSource),
    ("tree.sources.", TreeSources),
    ("tree.auto.", AutoSpeculation),
    ("tree.", TreeConfig),
    ("", EasySpecConfig),
)


def _describe_validation_error(exc: ValidationError) -> str:
    messages = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"]) or "<root>"
        if error["type"] == "extra_forbidden":
            prefix, owner = next((p, m) for p, m in _OPTION_GROUPS if field.startswith(p))
            options = ", ".join(owner.model_fields)
            messages.append(f"unknown option easyspec.{field}; the options of {('easyspec.' + prefix).rstrip('.')} "
                            f"are: {options}")
        elif error["type"] == "value_error":
            text = error["msg"].removeprefix("Value error, ")
            # Tree messages that start with a sub-option name read as easyspec.tree.<option> ...
            named = field == "tree" and text.split(" ", 1)[0].split("[", 1)[0] in TreeConfig.model_fields
            messages.append(f"easyspec.{field}.{text}" if named else f"easyspec.{field}: {text}")
        else:
            messages.append(f"easyspec.{field}: {error['msg']} (got {error.get('input')!r})")
    return "invalid --additional-config: " + "; ".join(messages)
