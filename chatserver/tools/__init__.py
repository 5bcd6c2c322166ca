"""The tools a model may call: the registry and its safety wrapper, and web_fetch."""
