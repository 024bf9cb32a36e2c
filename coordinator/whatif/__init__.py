"""What a fleet would buy before it exists: the simulator (the engine's own scheduler, planner
and standing rules on a virtual clock), the baselines it is compared with (a DTFM-style pipeline,
cloud GPUs) and the presets of models and fleets they run on.
"""
