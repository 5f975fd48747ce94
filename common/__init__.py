"""The shared library every service imports: config, model, engine, transfer, index."""
