"""The control plane: what runs in `pstar serve` and in a job's Ray driver. The lifecycle of
jobs (`jobs`, `reconciler`), their launch on Ray (`launcher`, `driver`, `local_ray`), uploads
(`files`), dry runs (`estimate`), logs and checkpoint downloads, and the checks before
serving (`preflight`). Workers and serving replicas never import from here.
"""
