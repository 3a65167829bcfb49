"""service: job lifecycle, the training loop around the engine, and the `pstar` CLI."""
