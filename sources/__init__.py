"""Sources: one module (or small package) per transport. Each depends on consumer_kit, never the
other way round."""
