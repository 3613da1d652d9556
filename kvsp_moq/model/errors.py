"""Errors of the reference model package (docs/model.md)."""

from __future__ import annotations

__all__ = ["ModelError", "SamplerError", "TokenizerError", "WeightsError"]


class ModelError(ValueError):
    """Bad input to the reference model: shapes, dtypes, layer order, token ids, config."""


class TokenizerError(ModelError):
    """A token id outside the vocabulary, or a tokenizer definition file that is not ours."""


class WeightsError(ModelError):
    """Weight files that are missing, corrupted or written for another configuration."""


class SamplerError(ModelError):
    """An unknown sampling method or invalid sampler parameters / state (kvsp-draft §6.8)."""
