"""Import shims: TorchServe's ``ts`` package paths, first on a worker's ``sys.path``, so unmodified
TorchServe handlers run against this server's implementation."""
