"""Scale-out on Ray Serve (`completer serve --cluster`): engine replicas as a
Serve deployment (`replica.py`), a session- and prefix-affine request router
(`routing.py`, `router.py`), and the front door's engine face that streams
through the deployment handle (`client.py`). Nothing here imports Ray until a
cluster is asked for; `routing.py` never does (`[cluster]` is completer/config/cluster.py)."""
