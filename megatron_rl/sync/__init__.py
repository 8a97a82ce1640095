"""The weight update trainers -> generators, whole: its messages (messages.py), its one coordinator
(coordinator.py: `WeightUpdate` over an `UpdateCycle`, talking through any transport with
send/send_all), the generator side (generator_side.py), the trainer ranks' part of a push
(trainer_push.py), and beneath them flat buckets (buckets.py), double-buffered bucket streams
(pipeline.py), update groups (group.py) and per-rank senders (sender.py). `update.py` runs one
whole update in one process. sync/ does not import control/: whatever carries the messages, the
update itself changes only here."""
