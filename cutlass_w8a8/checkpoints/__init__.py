"""compressed-tensors W8A8 checkpoints as Hugging Face models.

`from_pretrained` loads a checkpoint (llm-compressor's / compressed-tensors' int8 or fp8 W8A8 formats) into a
transformers model whose quantized linears are `W8A8Linear` layers holding the stored 8-bit weights and scales;
`save_pretrained` writes a model quantized with `quantize_` (or loaded) back in that format, only when
`from_pretrained` reads the result back (checked before and after writing);
`attach_quantization_config` makes a plain ``model.save_pretrained`` do the same. transformers and
compressed-tensors are imported only when these are called.
"""

from .load import from_pretrained
from .save import attach_quantization_config, quantization_config_of
from .write import save_pretrained

__all__ = ["from_pretrained", "save_pretrained", "attach_quantization_config", "quantization_config_of"]
