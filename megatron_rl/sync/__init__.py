"""Weight sync trainer -> generators: flat buckets (buckets.py), double-buffered bucket streams
(pipeline.py), update groups (group.py), per-rank senders (sender.py), the trainer ranks' part of a
push (trainer_push.py) and the versioned, all-or-nothing update with its one coordinator,
`UpdateCycle` (update.py)."""
