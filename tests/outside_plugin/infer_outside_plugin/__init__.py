"""A plugin of every kind, written to infer's plugin contracts as they stood at commit d7ec514 (plugin API 1).

Frozen: see the README. It declares no plugin API version, as no package did before versions existed.
"""
