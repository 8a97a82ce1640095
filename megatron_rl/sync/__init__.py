"""Weight sync trainer -> generators: flat buckets (buckets.py), update groups (group.py), per-rank
senders (sender.py) and the versioned, all-or-nothing update (update.py)."""
