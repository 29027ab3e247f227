"""pdctl: declarative prefill/decode SGLang fleets plus a torchrun trainer on bare metal."""

__version__ = "0.1.0"

__all__ = [
    "__version__",
]
