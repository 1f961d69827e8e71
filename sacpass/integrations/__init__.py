"""Hooks that turn sacpass on from inside other training frameworks, without editing them.

Each integration is its own module and imports its framework only when it is imported itself, so
``import sacpass`` never needs any of them:

- :mod:`sacpass.integrations.torchtitan`: a torchtitan override (``--override.imports``) that compiles each
  transformer block with the sacpass backend under torchtitan's ``FullAC``, ``SelectiveAC`` or
  ``MemoryBudgetAC``. See docs/torchtitan.md.
"""
