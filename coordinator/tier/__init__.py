"""A coordinator tier: one job's ranks on torch.distributed (``group.py``)."""
