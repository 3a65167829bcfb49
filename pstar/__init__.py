"""The composition root: the `pstar` command line, the uvicorn runner of the API and the
HTTP client of our own API. The only package that imports `api`, `service` and
`benchmarks` together; nothing imports it."""
