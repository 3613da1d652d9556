"""Samplers whose whole state is (method, params, seed, step) — the ``sampler`` member of a
Session Checkpoint (kvsp-draft §4.4) — so an instance resuming a session restores it at any
step and continues with the same draws (§6.8 step 3).

- ``greedy``: the argmax (first index on ties); params ``{}``.
- ``top-p``: nucleus sampling, params ``{"p": p, "temperature": t}``. Step ``s`` draws its
  uniform number from a fresh ``torch.Generator`` seeded with
  ``SHA-256("kvsp-ref-sampler-1" || 0x00 || uint64(seed) || uint64(s))[:8]``, so no draw depends
  on the draws before it. Probabilities are computed on the host in float64; the kept set is
  the smallest prefix of the tokens sorted by descending probability (ties by ascending id)
  whose mass reaches p.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from .errors import SamplerError

__all__ = ["GREEDY", "TOP_P", "Sampler", "SamplerState"]

GREEDY = "greedy"
TOP_P = "top-p"
_SEED_LABEL = b"kvsp-ref-sampler-1\x00"
_UINT64 = 1 << 64


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(params: Mapping[str, Any], name: str, default: float | None) -> float:
    value = params.get(name, default)
    if value is None:
        raise SamplerError(f"top-p needs the parameter {name!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SamplerError(f"sampler parameter {name} must be a finite number, got {value!r}")
    return float(value)


def _normalize(method: str, params: Mapping[str, Any]) -> Mapping[str, float]:
    if not isinstance(params, Mapping):
        raise SamplerError(f"sampler params must be an object, got {params!r}")
    if method == GREEDY:
        if params:
            raise SamplerError(f"greedy takes no parameters, got {sorted(params)}")
        return MappingProxyType({})
    if method == TOP_P:
        unknown = set(params) - {"p", "temperature"}
        if unknown:
            raise SamplerError(f"top-p has no parameters {sorted(unknown)} (p, temperature)")
        p = _number(params, "p", None)
        temperature = _number(params, "temperature", 1.0)
        if not 0.0 < p <= 1.0:
            raise SamplerError(f"top-p p must be in (0, 1], got {p}")
        if temperature <= 0.0:
            raise SamplerError(f"temperature must be > 0, got {temperature}")
        return MappingProxyType({"p": p, "temperature": temperature})
    raise SamplerError(f"unknown sampling method {method!r} ({GREEDY}, {TOP_P})")


@dataclass(frozen=True)
class SamplerState:
    """(method, params, seed, step): everything a sampler is (§4.4 ``sampler``, §6.8)."""

    method: str
    params: Mapping[str, float] = field(default_factory=dict)
    seed: int = 0
    step: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", _normalize(self.method, self.params))
        if not _is_int(self.seed) or not 0 <= self.seed < _UINT64:
            raise SamplerError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if not _is_int(self.step) or not 0 <= self.step < _UINT64:
            raise SamplerError(f"step must be an integer >= 0, got {self.step!r}")

    def at_step(self, step: int) -> SamplerState:
        return SamplerState(self.method, self.params, self.seed, step)

    def to_json(self, *, deterministic: bool = False) -> dict[str, Any]:
        """The checkpoint's ``sampler`` object (§4.4). ``deterministic`` is the instance's
        claim that every eligible instance produces bit-identical tokens (§4.4): only the
        deployment can know it, so it defaults to false."""
        return {"method": self.method, "params": dict(self.params), "seed": self.seed,
                "step": self.step, "deterministic": bool(deterministic)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SamplerState:
        """From a checkpoint's ``sampler`` object; unknown members (and ``deterministic``)
        are ignored (§4.4)."""
        if not isinstance(data, Mapping):
            raise SamplerError("sampler must be a JSON object")
        for member in ("method", "seed", "step"):
            if member not in data:
                raise SamplerError(f"sampler member {member!r} is REQUIRED")
        if not isinstance(data["method"], str):
            raise SamplerError("sampler method must be a string")
        return cls(data["method"], data.get("params", {}), data["seed"], data["step"])


def _step_generator(seed: int, step: int) -> torch.Generator:
    material = _SEED_LABEL + seed.to_bytes(8, "big") + step.to_bytes(8, "big")
    value = int.from_bytes(hashlib.sha256(material).digest()[:8], "big")
    return torch.Generator(device="cpu").manual_seed(value)


class Sampler:
    """Draws one token per call from ``[vocab]`` logits and advances its step."""

    def __init__(self, state: SamplerState) -> None:
        if not isinstance(state, SamplerState):
            raise SamplerError(f"a Sampler is made from a SamplerState, got {state!r}")
        self._state = state

    @classmethod
    def greedy(cls) -> Sampler:
        return cls(SamplerState(GREEDY))

    @classmethod
    def top_p(cls, p: float, temperature: float = 1.0, seed: int = 0) -> Sampler:
        return cls(SamplerState(TOP_P, {"p": p, "temperature": temperature}, seed))

    @classmethod
    def restore(cls, method: str, params: Mapping[str, Any], seed: int, step: int) -> Sampler:
        """§6.8 step 3: the sampler "with the given method, parameters, seed, and step"."""
        return cls(SamplerState(method, params, seed, step))

    @property
    def state(self) -> SamplerState:
        return self._state

    @property
    def step(self) -> int:
        return self._state.step

    def sample(self, logits: torch.Tensor) -> int:
        """The token for the current step; then step += 1."""
        if not isinstance(logits, torch.Tensor) or logits.ndim != 1 or logits.numel() == 0:
            raise SamplerError("logits must be a non-empty 1-D tensor [vocab]")
        host = logits.detach().to(device="cpu", dtype=torch.float64)
        if torch.isnan(host).any() or not torch.isfinite(host).any():
            raise SamplerError("logits contain NaN or no finite value")
        state = self._state
        token = int(torch.argmax(host)) if state.method == GREEDY else self._top_p(host, state)
        self._state = state.at_step(state.step + 1)
        return token

    @staticmethod
    def _top_p(logits: torch.Tensor, state: SamplerState) -> int:
        probs = torch.softmax(logits / state.params["temperature"], dim=0)
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        cumulative = torch.cumsum(sorted_probs, dim=0)
        # keep tokens whose preceding mass is below p: the smallest prefix reaching p
        keep = int(torch.count_nonzero(cumulative - sorted_probs < state.params["p"]))
        keep = max(keep, 1)
        kept = cumulative[:keep]
        u = torch.rand((), generator=_step_generator(state.seed, state.step), dtype=torch.float64)
        target = u * kept[-1]
        pick = min(int(torch.searchsorted(kept, target, right=True)), keep - 1)
        return int(order[pick])
