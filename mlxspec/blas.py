"""Linux only: make MLX's CPU backend use an optimized BLAS (see issue 6). Owned by the BLAS work."""


def setup() -> None:
    """Load an optimized BLAS before ``mlx.core`` is imported (no-op until implemented)."""


def blas_report(measure: bool = True) -> dict:
    """Which BLAS MLX uses (placeholder until the BLAS loader lands)."""
    return {"library": "reference (bundled with mlx)"}
