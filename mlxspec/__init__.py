"""mlxspec: fast local LLM inference on MLX.

Two levers on the memory-bandwidth wall of decoding, stacked: zero-point weight quantization
(de-quantized on the fly by custom Metal kernels) and lossless speculative decoding.

On Linux the optimized-BLAS setup must run before ``mlx.core`` is imported, so it comes first.
"""

from mlxspec import blas as _blas

_blas.setup()

from mlxspec.batch import batch_generate  # noqa: E402
from mlxspec.errors import MlxspecError  # noqa: E402
from mlxspec.generate import generate, stream_generate  # noqa: E402
from mlxspec.load import load  # noqa: E402

__version__ = "0.1.0"

__all__ = ["MlxspecError", "batch_generate", "generate", "load", "stream_generate", "__version__"]
