"""The machine file's figures at their former path (now plan/machine.py), for the imports that still name it;
import them from `slide_scheduler` instead."""

from .plan.machine import Disk, Gpu, Host, Machine, Pcie

__all__ = ["Disk", "Gpu", "Host", "Machine", "Pcie"]
