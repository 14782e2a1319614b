"""Training of the embedded default models: corpus, FIM examples, trainer."""
