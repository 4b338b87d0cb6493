"""A checkpoint's ``generation_config.json``: the tokens that end generation, and the sampling
defaults its authors chose, applied to any request that leaves a parameter out.

As vLLM's ``--generation-config auto`` (and SGLang's model sampling defaults) do, the fields
taken are ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and
``max_new_tokens``; ``do_sample`` and ``max_length`` are not (a request's ``temperature`` alone
decides greedy vs sampled). ``--generation-config`` picks the source:

- ``auto`` (default): the model directory's file, if there is one;
- ``ignore``: no sampling defaults (tpserve's / OpenAI's own apply); its EOS ids still stop
  generation, since they say where the model's answers end, not how to sample;
- ``DIR``: that directory's ``generation_config.json`` instead of the model's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tpserve.engine.sampling_params import SamplingParams
from tpserve.errors import ConfigError

log = logging.getLogger(__name__)

FLAG = "--generation-config"
FILE = "generation_config.json"
# generation_config.json field -> sampling parameter it provides the default of.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                   "max_new_tokens")
# A request must fit the server's limits even when it only inherits a default (checked here
# against nothing larger than this; the per-server cap is applied in ``with_defaults``).
_NO_LIMIT = 1 << 62


@dataclass(frozen=True)
class GenerationDefaults:
    sampling: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    eos_token_ids: tuple[int, ...] = ()
    source: str = ""  # the file read, "" when none

    def info(self) -> dict[str, Any]:
        """What ``/get_model_info`` shows."""
        return {"generation_config": self.source or None,
                "sampling_defaults": dict(self.sampling),
                "generation_eos_token_ids": list(self.eos_token_ids)}


def _eos(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def _sampling(raw: Mapping[str, Any], path: Path) -> dict[str, Any]:
    picked = {k: raw[k] for k in SAMPLING_FIELDS if raw.get(k) is not None}
    if picked.get("top_k") == 0:  # transformers: 0 disables top-k; tpserve spells that -1
        picked["top_k"] = -1
    try:
        SamplingParams.from_dict(picked).validate(_NO_LIMIT, _NO_LIMIT)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}", flag=FLAG) from None
    return picked


def _read(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}", flag=FLAG) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} is not a JSON object", flag=FLAG)
    return raw


def load_generation_config(model_dir: Path, mode: str = "auto") -> GenerationDefaults:
    """The defaults in force for ``--generation-config mode`` (auto | ignore | DIR)."""
    if mode not in ("auto", "ignore"):
        path = Path(mode).expanduser()
        path = path / FILE if path.is_dir() else path
        if not path.is_file():
            raise ConfigError(f"missing {FILE}: {path} does not exist", flag=FLAG)
        raw = _read(path)
        return GenerationDefaults(MappingProxyType(_sampling(raw, path)),
                                  _eos(raw.get("eos_token_id")), str(path))
    path = model_dir / FILE
    if not path.is_file():
        return GenerationDefaults()
    raw = _read(path)
    sampling = {} if mode == "ignore" else _sampling(raw, path)
    return GenerationDefaults(MappingProxyType(sampling), _eos(raw.get("eos_token_id")),
                              str(path))


def stop_token_ids(config_eos: Iterable[int], gen: GenerationDefaults) -> frozenset[int]:
    """Every EOS id of config.json and generation_config.json (either may hold a list)."""
    return frozenset(int(t) for t in config_eos) | frozenset(gen.eos_token_ids)


def with_defaults(raw: Mapping[str, Any] | None, defaults: Mapping[str, Any],
                  max_new_tokens_cap: int | None = None) -> dict[str, Any]:
    """A request's sampling parameters with the defaults filling what it left out.

    A key the request sets (null counts as unset) wins; an inherited ``max_new_tokens`` is
    capped at ``max_new_tokens_cap`` so a default can never make a request invalid.
    """
    merged = dict(raw or {})
    for key, value in defaults.items():
        if merged.get(key) is None:
            if key == "max_new_tokens" and max_new_tokens_cap is not None:
                value = min(int(value), max_new_tokens_cap)
            merged[key] = value
    return merged


def log_defaults(gen: GenerationDefaults, mode: str) -> None:
    if gen.sampling:
        log.info("sampling defaults from %s: %s (requests override; --generation-config ignore "
                 "drops them)", gen.source, json.dumps(dict(gen.sampling)))
    else:
        log.info("sampling defaults: none (%s)", "--generation-config ignore" if mode == "ignore"
                 else f"no {FILE} fields to use")
