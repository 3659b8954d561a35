"""Hugging Face transformers attention backend: ``attn_implementation="attnkit"``.

Importing this package registers "attnkit" with transformers' ``AttentionInterface`` (the
function every attention layer calls, :mod:`.attention`) and ``AttentionMaskInterface`` (the
function the model calls once per forward to build its masks, :mod:`.masks`)::

    import attnkit.integrations.transformers  # noqa: F401  (registers "attnkit")
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="attnkit")

Every attention layer then runs :func:`attnkit.attention`:

* GQA / MQA without ``repeat_kv``: k, v (B, Hkv, Sk, D) go in as they are.
* Masks stay typed. The mask function recognises transformers' causal, sliding-window and
  bidirectional patterns and hands the layers an :class:`AttnkitMask` holding
  ``Causal`` / ``SlidingWindow`` (placed by the cache's ``q_start``) ``& KeyPadding`` (from the 2-D
  ``attention_mask``: per-row lengths when it is left or right padding, so the whole mask is one
  key interval per query); nothing (B, Sq, Sk)-sized is built for them. Any other
  pattern (packed sequences, custom ``or``/``and`` mask functions, chunked attention) is
  materialized exactly as transformers' SDPA mask would be.
* A model that reads the mask itself (DeepSeek sparse attention's indexer slices it, Doge builds
  its dynamic mask from it) gets a real tensor: the :class:`AttnkitMask` materializes, on first
  use by torch, to the bool (B, 1, Sq, Sk) tensor transformers' SDPA mask would be. A model
  that extends the mask only when it is eager's float tensor (DeepSeek-V4's compressed keys)
  gets that tensor (:data:`.masks.EAGER_MASK_MODEL_TYPES`).
* A dense 4-D mask a user passes is accepted: bool True = attend, float added to the scores
  (values at or below the dtype's minimum, transformers' "masked" sentinel, mean masked).
* ``scaling``, dropout (``dropout`` is already 0 in eval), ``softcap`` (Gemma 2's
  ``attn_logit_softcapping``), ``s_aux`` / ``sinks`` of one logit per head (gpt-oss) or per
  query (Inkling 2), ``position_bias`` (T5-style), ``indices`` (DeepSeek sparse attention's top-k keys, as a
  ``SelectedKeys`` mask) and ``block_indices`` (MiniMax-M3's key blocks per KV group, as a
  ``SelectedBlocks`` mask) pass through to :func:`attnkit.attention`, nothing (Sq, Sk)-sized
  built for the selections; attention weights come back whenever transformers
  records them (``output_attentions=True``).
* Every other keyword argument a model passes is either known to leave the result unchanged
  (:data:`HARMLESS_KWARGS`) or refused with an error naming it: silently ignoring, say, a
  sparse selection would give dense attention and different outputs.
* A model attnkit cannot serve is refused when it is built (``from_pretrained`` /
  ``from_config`` / ``set_attn_implementation``), naming the model: one whose attention layers
  do not call transformers' attention interface (BLOOM, Falcon, GIT) would never run attnkit
  (:mod:`.refusals`, :func:`unserved_reason`).

Fully masked query rows: a query with no key to attend to (a left-padding position, or a row
of a user's 4-D mask that is all masked) gets an output of exactly 0, as SDPA gives for a bool
mask; ``eager`` (and SDPA with a float mask) give the mean of every value instead. Other
positions see that difference only through keys they may attend to: transformers' padding masks
hide padded keys from every query, so real positions are unaffected by padding; a user's mask
whose fully masked row is still visible as a key to later queries carries it into the next layer.

Shapes (transformers' convention at the interface): query (B, Hq, Sq, D), key (B, Hkv, Sk, D),
value (B, Hkv, Sk, Dv); the output goes back as (B, Sq, Hq, Dv).
"""

from __future__ import annotations

try:  # every name the package uses, so that a missing one gets the hint below
    from transformers import AttentionInterface, PreTrainedModel  # noqa: F401
    from transformers.masking_utils import (  # noqa: F401
        AttentionMaskInterface,
        bidirectional_mask_function,
        causal_mask_function,
        sdpa_mask,
    )
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised by the missing-package test
    raise ImportError(f"attnkit.integrations.transformers needs Hugging Face transformers "
                      f"(pip install 'attnkit[hf]'): {e}") from None

from .attention import HARMLESS_KWARGS, NAME, attention_forward
from .masks import AttnkitMask, make_mask
from .refusals import install_load_check, unserved_reason

__all__ = ["NAME", "HARMLESS_KWARGS", "AttnkitMask", "attention_forward", "make_mask", "register",
           "unserved_reason"]


def register(name: str = NAME) -> str:
    """Register the attention and mask functions with transformers under ``name`` (done for
    "attnkit" on import); returns the name."""
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, make_mask)
    install_load_check()
    return name


register()
