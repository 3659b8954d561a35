"""Adapters that plug attnkit into other libraries. Each submodule imports its library, so none
is imported by ``import attnkit``; import the one you need:

* :mod:`attnkit.integrations.transformers`: registers ``attn_implementation="attnkit"`` with
  Hugging Face transformers (``pip install 'attnkit[hf]'``).
"""
