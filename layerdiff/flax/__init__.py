"""Flax NNX models as layerdiff cases: captured into the same trace as torch models
(:mod:`layerdiff.flax.capture`), given a torch reference's weights through a mapping
(:mod:`layerdiff.flax.weights`).

The only part of layerdiff that imports JAX at module level; nothing outside it imports this
package at module level, so ``import layerdiff`` and every torch path stay free of JAX.
"""
