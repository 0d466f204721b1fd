"""The Ray Serve endpoint: answers on demand with the pipeline's method, store and engines."""
