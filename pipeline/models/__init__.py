"""Models: the registry, their files, sessions, providers, TensorRT engines, caches and stand-ins."""
