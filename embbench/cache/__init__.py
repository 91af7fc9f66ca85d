"""The frequency-aware GPU software cache (``freqcache``), embbench's featured strategy."""

from embbench.cache.freqcache import FreqCache, FreqCacheParams, FreqCacheStrategy

__all__ = ["FreqCache", "FreqCacheParams", "FreqCacheStrategy"]
