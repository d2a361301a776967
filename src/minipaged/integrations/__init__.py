"""Adapters that plug minipaged's kernels into other libraries.

Submodules import their library lazily: `minipaged.integrations.transformers`
needs the `transformers` package (extra "hf"), nothing else does.
"""
