"""What a target model can do, read from the model and its cache (never from its name)."""

from __future__ import annotations

from typing import Any

from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from dflash_robot.errors import UnsupportedModelError


def is_stateful(model: Any, cache: DynamicCache | None = None) -> bool:
    """Stateful (hybrid) by capability: the flag, or linear-attention/SSM layers in its cache."""
    if bool(getattr(model, "_is_stateful", False)):
        return True
    cache = cache if cache is not None else new_cache(model)
    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers)


def new_cache(model: Any) -> DynamicCache:
    try:
        return DynamicCache(config=model.config)
    except Exception as e:  # noqa: BLE001 - any failure here means we cannot manage this cache
        raise UnsupportedModelError(
            f"{type(model).__name__}: cannot build a DynamicCache for it ({type(e).__name__}: {e})") from e
