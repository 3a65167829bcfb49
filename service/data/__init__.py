"""A job's training rows: files validated line by line (`datasets`, `preference`), packed
into rows (`packing`) and prepared for a plan (`prepare`); the text of a `pstar train` spec
(`text`). Run by the control plane (uploads, dry runs), by a job's driver and by
`pstar train`; imports neither the control plane nor the HTTP schema.
"""
