"""Model analysis: `summary` (parameters, MACs, memory, bandwidth) and `intercept`."""

from ._intercept import intercept as intercept
from ._summary import Summary as Summary
from ._summary import summary as summary

__all__ = [
    "intercept", "Summary", "summary"
]
