"""Sources: one module per transport, each depending on ``consumer_kit`` and never the other way round."""
