"""Models attnkit cannot serve, refused when they are built (``from_pretrained`` /
``from_config`` / ``set_attn_implementation``) with an error naming the model, instead of
running them wrong or failing at the first forward."""

from __future__ import annotations

import functools
import sys
from typing import Callable

import torch
from transformers import PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .attention import NAME, attention_forward

__all__ = ["unserved_reason", "install_load_check"]


# Models that call the attention interface but need something attnkit does not do, found by
# running every causal LM of transformers 5.24 on "attnkit" against "eager". The attention
# function refuses their arguments too (at the first forward); naming them here moves the error
# to load time. model_type -> (whether a config of it is affected, why). In transformers 5.24
# every such model is served.
_UNSERVED_MODEL_TYPES: dict[str, tuple[Callable, str]] = {}


def unserved_reason(model: PreTrainedModel) -> str | None:
    """Why ``attn_implementation="attnkit"`` cannot serve ``model`` (a PreTrainedModel, checked
    per class: a composite model's sub-models are checked as they are built), or None.

    * A model whose attention layers do not call transformers' attention interface (BLOOM,
      Falcon, MPT, BigBird, and others written before it) would compute attention its own way on
      attnkit's mask object. transformers' own test for "can this model switch implementation"
      (the modeling file defines attention modules but never fetches an interface function)
      finds them.
    * A model of :data:`_UNSERVED_MODEL_TYPES` needs something attnkit does not do."""
    cls, config = type(model), model.config
    if not cls._can_set_attn_implementation():
        return (f"{cls.__name__} ({config.model_type}) computes attention in its own code instead of calling "
                f"transformers' attention interface, so attn_implementation='{NAME}' would never run attnkit")
    affected, why = _UNSERVED_MODEL_TYPES.get(config.model_type, (lambda config: False, ""))
    if affected(config):
        return f"{cls.__name__} ({config.model_type}) {why}"
    return None


def _guard_layer_tables(model: PreTrainedModel, implementation: str) -> None:
    """Give the model's tables of attention classes per implementation an entry for ours that
    raises a clear error when a layer is built from it.

    Some modeling files pick an attention class by name from a module-level table
    (``GIT_SELF_ATTENTION_CLASSES = {"eager": GitSelfAttention}``; SAM's vision encoder, which the
    DeepSeek-OCR models embed); those classes compute attention in their own code. A model built
    with attnkit would fail there with ``KeyError: 'attnkit'``. Which sub-model builds from the
    table is not known before it is built (an OCR model's text part shares the file with its
    SAM encoder and can run attnkit), so the error is raised where the table is read."""
    module = sys.modules.get(type(model).__module__)
    for table_name, table in list(vars(module).items()) if module is not None else ():
        if not (isinstance(table, dict) and "eager" in table and implementation not in table
                and all(isinstance(c, type) and issubclass(c, torch.nn.Module) for c in table.values())):
            continue

        def refuse(*args, _table=table_name, _choices=tuple(table), **kwargs):
            raise ValueError(
                f"{type(model).__name__} ({model.config.model_type}) builds attention layers from {_table}, a table "
                f"of classes that compute attention in their own code, one per implementation {_choices}, none for "
                f"'{implementation}'. Load it with one of those (for a composite model, give '{implementation}' only "
                f"to the parts that call transformers' attention interface, e.g. {{'text_config': '{implementation}', "
                f"'vision_config': 'sdpa'}}).")

        table[implementation] = refuse


def _is_ours(implementation) -> bool:
    return isinstance(implementation, str) and ALL_ATTENTION_FUNCTIONS.get(implementation) is attention_forward


def install_load_check() -> None:
    """Refuse, when a model is built or switched to attnkit, a model attnkit cannot serve.

    transformers checks per model class that it can run "sdpa", "flash_attention_*" and
    "flex_attention" (``_sdpa_can_dispatch`` and friends) but has no such check for an
    implementation registered through ``AttentionInterface`` (transformers 5.24). Every model
    construction and ``set_attn_implementation`` resolves the implementation through
    ``PreTrainedModel.get_correct_attn_implementation`` with the model at hand, so that is
    wrapped (once) to call :func:`unserved_reason` when the answer is attnkit's function, and to
    guard the model's tables of attention classes (:func:`_guard_layer_tables`)."""
    current = PreTrainedModel.get_correct_attn_implementation
    # Registering again (another name, or this module reloaded) replaces our wrapper rather than
    # stacking a second one around it.
    original = getattr(current, "attnkit_original", current)  # our wrapper says what it wraps

    @functools.wraps(original)
    def get_correct_attn_implementation(self, requested_attention, is_init_check=False):
        chosen = original(self, requested_attention, is_init_check)
        if _is_ours(chosen):
            reason = unserved_reason(self)
            if reason is not None:
                raise ValueError(f"{reason}. Load it with attn_implementation='sdpa' or 'eager' (for a composite "
                                 f"model, a dict such as {{'text_config': '{NAME}', 'vision_config': 'sdpa'}}).")
            _guard_layer_tables(self, chosen)
        return chosen

    get_correct_attn_implementation.attnkit_original = original
    PreTrainedModel.get_correct_attn_implementation = get_correct_attn_implementation
