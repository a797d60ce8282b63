from verinfer.numerics.config import Numerics

__all__ = ["Numerics"]
