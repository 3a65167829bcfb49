"""Tools beside the service: `pstar plan` (`planning`), `pstar plot-trace` (`plot_trace`) and
a throw-away PostgreSQL for tests and benchmarks (`pg_local`)."""
