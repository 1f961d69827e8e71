"""The layer benchmark's parts (``benchmarks/bench_layer.py`` is its command line):

- :mod:`.variants`: the layer, its inputs, and the registry of named variants (one decorated builder each);
- :mod:`.measure`: clocks, one fwd+bwd step with top-k run counts, timing a variant, timing the top-k alone;
- :mod:`.results`: the JSON result (new or merged into an earlier run's), markdown table, targets;
- :mod:`.plot`: step time / control versus S (matplotlib; skipped with a note without it).
"""
