"""``lmforge plan``: the layouts a model can train in on N devices, their memory model, and probes that
run a real step of a layout to measure it."""
