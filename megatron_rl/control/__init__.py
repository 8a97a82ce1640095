"""The MPI controller and the asynchronous training loop (`megatron-rl train`)."""
