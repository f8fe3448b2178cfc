"""What goes where, decided before a run: the placement, the choices and the planner that makes one, the cost
model that prices it on a machine, the disk tier's stripe and the fixed buffers' sizes. It imports neither the
engine (run/) nor the probe (measure/)."""
