"""The engine: hashing, block pool, scheduler (pure), model runner and the engine loop."""
