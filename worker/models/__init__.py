"""Built-in model handlers and the loader for user models (see ``registry.load_model``)."""
