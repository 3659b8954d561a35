"""A small Llama-style decoder built from attnkit attention (MHA, GQA, MQA or MLA), Hugging Face
checkpoint loading, and fast batched generation.

    >>> from attnkit.models import Decoder, DecoderConfig
    >>> model = Decoder(DecoderConfig(vocab_size=64, hidden_size=32, num_heads=4, attention="mqa")).eval()
    >>> len(model.generate([[1, 2, 3]], max_new_tokens=5).tokens[0])
    5
"""

from .config import ATTENTION_VARIANTS, HIDDEN_ACTS, DecoderConfig
from .decoder import CACHE_KINDS, Decoder, DecoderLayer, GatedMLP, RMSNorm, SwiGLU, layer_cache_kind, make_cache
from .generation import Generation, generate, sample_next, stream
from .loading import config_from_hf, load_pretrained, read_checkpoint, read_safetensors

__all__ = ["DecoderConfig", "ATTENTION_VARIANTS", "HIDDEN_ACTS", "Decoder", "DecoderLayer", "RMSNorm", "GatedMLP",
           "SwiGLU", "make_cache", "layer_cache_kind",
           "CACHE_KINDS", "generate", "stream", "Generation", "sample_next", "load_pretrained", "config_from_hf",
           "read_safetensors", "read_checkpoint"]
