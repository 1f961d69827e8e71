"""What the tests share: the toy layer and its custom ops, the fuzzing vocabulary, the golden cases, dumps, and
the one similarity measure for lossy comparisons. Imported as ``tests.support.<module>`` from the repository root."""
