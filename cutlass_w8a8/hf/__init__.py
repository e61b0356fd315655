"""transformers models at the speed of the package's own decoder: `optimize_` (fused q/k/v and gate/up
`W8A8Linear` layers, RMSNorm and SiLU*mul fused with the activation quantization; transformers' state-dict layout
and module names kept; `unoptimize_` undoes it), `generate` (eager prefill,
then decode steps replayed from CUDA graphs on a ``StaticCache``; `GraphGenerator`), and the loading / saving
entry points that know about them (`from_pretrained` with ``optimize=True``, `save_pretrained` writing the
unfused layout).

Layering: this package sits above ``checkpoints/`` and ``distributed/`` and calls them; they never import it.
That is why the top-level ``cutlass_w8a8.from_pretrained`` / ``save_pretrained`` are the ones defined here (thin
wrappers: ``checkpoints.from_pretrained`` then `optimize_`; `unfused` around ``checkpoints.save_pretrained``),
while ``cutlass_w8a8.checkpoints.from_pretrained`` stays the plain loader. transformers is imported only when a
function is called.
"""

from .api import from_pretrained, save_pretrained
from .decode_step import DecodeStep
from .generate import GraphGenerator, SUPPORTED_GENERATE_KWARGS, generate
from .optimize import SUPPORTED_LAYERS, TESTED_TRANSFORMERS, is_optimized, optimize_
from .unfuse import RMSNormQuant, unfused, unoptimize_

__all__ = ["optimize_", "unoptimize_", "unfused", "is_optimized", "RMSNormQuant", "SUPPORTED_LAYERS",
           "TESTED_TRANSFORMERS", "generate", "GraphGenerator", "DecodeStep", "SUPPORTED_GENERATE_KWARGS",
           "from_pretrained", "save_pretrained"]
