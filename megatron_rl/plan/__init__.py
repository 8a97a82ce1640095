"""Planning a run before it starts, offline (no rank runs any of it but the rank layout): the rank
layout of a config (layout: which MPI rank plays which role; the runtime reads it too), placement of
those ranks on nodes and GPUs (placement), srun's PMI plugin for this environment's MPI library (srun),
per-GPU memory and throughput estimates (estimate, with step_memory measuring a real step against the
formulas), and the discrete-event simulator of the async pipeline (simulate, simulate_models,
simulate_calibration). `megatron-rl plan`, `estimate` and `simulate` share it; it imports nothing of
control/."""
