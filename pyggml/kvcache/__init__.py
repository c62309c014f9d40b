"""KV caches: one interface (``Cache``), several memory layouts.

``Causal`` (optionally sliding-window or chunked) stores keys/values of decoder layers;
``Cells`` is its tensor-free bookkeeping.
"""

from pyggml.kvcache.base import Cache, CacheConfig, CacheFullError, NotSupportedError, ShiftFn
from pyggml.kvcache.causal import Causal
from pyggml.kvcache.cells import Cells

__all__ = ["Cache", "CacheConfig", "CacheFullError", "Causal", "Cells", "NotSupportedError", "ShiftFn"]
