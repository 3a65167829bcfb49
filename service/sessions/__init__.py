"""Training-primitive sessions: a user's own loop (Tinker's `forward_backward`,
`optim_step`, `sample`, save and load) driving the chunk engine."""
