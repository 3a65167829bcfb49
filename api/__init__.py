"""HTTP: the FastAPI app, OpenAI-compatible routes and ours, auth, the error envelope.

Nothing here knows Ray or the database; routes call `service/`.
"""
