"""The engine: a plan made from a catalog and steps (plan.py), run on a process group (stream.py, dist.py), with
lost ranks noticed (peer_watch.py) and the same plan replayed to compare (compare.py)."""
