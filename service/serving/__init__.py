"""Serving the models jobs train: which Ray Serve deployment answers for a model
(`deployments`), the deployment itself (`model_server`) and the decoding in a replica
(`generation`). A replica imports neither the control plane nor the HTTP schema.
"""
