"""The measured claims behind `pstar bench ...`: each benchmark prints a table for people
and one JSON line last for machines. Benchmarks may import every package here (the engine,
the service, the API app); nothing imports them but the CLI."""
