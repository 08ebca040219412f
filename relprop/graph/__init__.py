"""The graph layer: a model captured with ``torch.export`` (``capture``, cached in memory and on disk:
``disk_cache``) and what relprop reads from the captured graph (its nodes, attention blocks, tokens,
parameters). Nothing here imports a layer above the errors; the modules are imported by name
(``relprop.graph.capture``), this file imports none of them.
"""
