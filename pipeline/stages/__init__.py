"""The six stages, in data-flow order: prepare, extract, vocab, train, export, evaluate."""
