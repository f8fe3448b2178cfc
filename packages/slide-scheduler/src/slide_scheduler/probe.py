"""The probe at its former path (now measure/probe.py), for the imports that still name it; import
`probe_machine` and `probe_gpu` from `slide_scheduler` instead."""

from .measure.probe import probe, probe_gpu

__all__ = ["probe", "probe_gpu"]
