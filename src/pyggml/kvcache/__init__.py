"""KV caches: one interface (``Cache``), several memory layouts.

``Causal`` (optionally sliding-window or chunked) stores keys/values of decoder layers;
``Encoder`` keeps a multimodal input's cross-attention keys/values across batches; ``Wrapper``
routes each layer to one of several caches; ``Recurrent`` holds the per-sequence states of recurrent layers
(short convolutions, scans). ``Cells`` is Causal's tensor-free bookkeeping.
"""

from pyggml.kvcache.base import Cache, CacheConfig, CacheFullError, KVGroup, NotSupportedError, ShiftFn
from pyggml.kvcache.causal import Causal
from pyggml.kvcache.cells import Cells
from pyggml.kvcache.encoder import Encoder
from pyggml.kvcache.recurrent import Recurrent
from pyggml.kvcache.wrapper import Wrapper

__all__ = ["Cache", "CacheConfig", "CacheFullError", "Causal", "Cells", "Encoder", "KVGroup", "NotSupportedError",
           "Recurrent", "ShiftFn", "Wrapper"]
