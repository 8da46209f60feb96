"""A worker process: one engine driven by protocol messages from the frontend.

    python -m splitserve.cluster.worker '<WorkerSpec as JSON>'
"""
