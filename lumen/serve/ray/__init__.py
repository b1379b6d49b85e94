"""`python -m lumen.serve --replicas N [--ray-address ADDR]`: Lumen on Ray Serve, N engine replicas behind one
OpenAI endpoint (pip install -e '.[ray]').

    app.py       the Ray Serve application: the ingress deployment (the same FastAPI app as one process) over
                 the engine deployment; starting, serving until a signal, stopping
    local.py     the local Ray instance (without --ray-address): its own temp dir, stopped with every process
    replica.py   the engine deployment: one Engine and its EngineWorker per replica; streams outputs back
    remote.py    the ingress's worker: EngineWorker's interface over a deployment handle (the wire format)
    router.py    the request router (Ray Serve's public request-router API): prefix-aware, or power of two
    metrics.py   /metrics: every replica's lumen: series with a replica label, and the router's decisions

    HTTP -> Ray's proxy -> ingress (tokenize, validate) -> router (choose a replica) -> replica (engine steps)
"""
