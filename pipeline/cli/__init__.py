"""The `memstream` command line: one module per command, the flags they share in `flags`."""
