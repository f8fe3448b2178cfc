"""The engine that executes a placement, and its parts: lanes, loads, updates and the homes of gradients,
masters, moments and boundary activations. It reads the plan (plan/) and never the probe (measure/)."""
