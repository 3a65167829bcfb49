"""service: fine-tuning jobs around the engine, in folders by where their code runs.

- `spec/`: what a job is (request, stored spec, run plan); `methods/`: training methods as
  plugins; `data/`: training rows. Every runtime reads these.
- `control/`: `pstar serve` and a job's Ray driver; `store/`: the database.
- `worker/`: training workers and `pstar train`; `serving/`: Ray Serve replicas. Neither
  imports `control/` or the HTTP request schema (tests/test_structure_script.py).
- `settings`, `errors`, `faults`, `adapters`, `registry`: shared by all of them.
- `tools/`: `pstar plan`, `pstar plot-trace`, a throw-away PostgreSQL.
"""
