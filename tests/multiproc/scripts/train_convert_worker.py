"""torchrun worker (2 ranks) for tests/multiproc/test_train_convert.py.

argv: CASES_JSON OUT_JSON. Each case: {src, ckpt, to_megatron: {tp, pp}, exports: [{out, tp, pp, shard_mb}]}.
Converts src -> dist checkpoint at one layout, then back to HF at each export layout (resharding),
all through megatron_rl.train.convert; rank 0 writes what each export reported to OUT_JSON.
"""
import json
import sys

import torch


def main() -> None:
    import torch.distributed as dist

    from megatron_rl.train.convert import hf_to_megatron, megatron_to_hf
    from megatron_rl.train.parallel import ParallelLayout

    torch.set_num_threads(1)
    cases = json.load(open(sys.argv[1]))
    report = {}
    for case in cases:
        m = case["to_megatron"]
        hf_to_megatron(case["src"], case["ckpt"], ParallelLayout(m["tp"], m["pp"], dp=0, ep=m.get("ep", 1)), backend="gloo")
        for e in case["exports"]:
            r = megatron_to_hf(case["ckpt"], e["out"], ParallelLayout(e["tp"], e["pp"], dp=0),
                               max_shard_bytes=e["shard_mb"] << 20, backend="gloo")
            peaks = [None] * dist.get_world_size()
            dist.all_gather_object(peaks, r.peak_buffer_bytes)
            report[e["out"]] = {"files": list(r.files), "peak_buffer_bytes": max(peaks)}
    if dist.get_rank() == 0:
        json.dump(report, open(sys.argv[2], "w"))
    print("WORKER OK", flush=True)


if __name__ == "__main__":
    main()
