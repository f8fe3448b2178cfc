"""The expert overrides' field metadata at its former path (now plan/choices.py), for the imports that still name
it; import `expert` from `slide_scheduler` instead."""

from .plan.choices import expert

__all__ = ["expert"]
