"""What a job is: the request as a client sends it (`request`), the spec decided once from it
and stored as the job's plan (`job`), the typed run plan the worker loop runs (`run_plan`),
a YAML spec for `pstar train` (`train`), and what a job may ask of the cluster (`resources`).

Every runtime reads these; they import no other part of the service but `methods`,
`settings` and `errors`.
"""
