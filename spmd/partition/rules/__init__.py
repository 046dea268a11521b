"""Sharding rules: for each primitive family a function ``op -> OpShardingRule`` (factors.py).

The rules are plain functions; ``spmd/partition/catalog.py`` registers them, with the rest of each
primitive's record, keyed by the primitive object.
"""
