"""Execution: compiled plans and sessions."""
from odt_ops.runtime.plan import Plan
from odt_ops.runtime.session import InferenceSession

__all__ = ["InferenceSession", "Plan"]
