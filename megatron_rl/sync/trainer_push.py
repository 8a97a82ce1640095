"""The PUSHING phase on the trainer ranks (see coordinator.py): all of them export, a few send.

Every trainer rank iterates the HF export of its model chunks (the TP gathers are collective); the
first TP/DP rank of each pipeline stage is that stage's sender and streams the tensors to every
generator (one `WeightSender` per stage, several stages in parallel). The ranks then gather what
was sent, and the push is complete only if the senders together covered every stage's names.
Its `PushReport` answers the coordinator's PushRequest (control/trainer_worker.py carries both).

With `adapters=True` (trainer.lora.push: adapter) the push sends only the LoRA adapters: every rank
takes part in gathering them (collective), global rank 0 loads them into every generator
(sync/adapter_push.py); the base weights never leave the trainers.
"""
from __future__ import annotations

import torch.distributed as dist

from megatron_rl.sync.messages import PushReport
from megatron_rl.sync.sender import SyncTarget, WeightSender, WeightSyncError
from megatron_rl.sync.update import check_complete


class TrainerPush:
    def __init__(self, model_chunks: list, bucket_mb: float, node_addr: str, adapters: bool = False,
                 base_model: str = ""):
        from megatron.core import parallel_state as ps

        self.model_chunks, self.bucket_mb, self.node_addr = model_chunks, bucket_mb, node_addr
        self.adapters, self.base_model = adapters, base_model
        # one sender per PP stage: CP ranks hold the same weights, like DP ranks
        self.is_sender = (ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
                          and ps.get_context_parallel_rank() == 0)
        self.stage = ps.get_pipeline_model_parallel_rank()
        self.sender: WeightSender | None = None

    def push(self, version: int, targets: list[SyncTarget]) -> PushReport:
        """Send this rank's part (collective over the trainers); the report of the whole push."""
        from megatron_rl.train.hf_weights import export_hf_tensors, hf_names_of_stage

        if self.adapters:
            return self._push_adapters(version, targets)
        tensors = export_hf_tensors(self.model_chunks)  # collective over TP: every rank iterates
        report = None
        if self.is_sender:
            if self.sender is None:
                self.sender = WeightSender(self.stage, targets, bucket_mb=self.bucket_mb, address=self.node_addr)
            else:
                self.sender.retarget(targets)
            report = self.sender.send(tensors)
        else:
            for _ in tensors:
                pass
        expected = sorted(hf_names_of_stage(self.model_chunks)) if self.is_sender else []
        sent = (report.names, report.bytes, report.seconds) if report else ([], 0, 0.0)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (expected, *sent))
        check_complete((n for g in gathered for n in g[1]), (n for g in gathered for n in g[0]))
        return PushReport(version, tensors=len({n for g in gathered for n in g[1]}),
                          bytes=sum(g[2] for g in gathered), send_s=max(g[3] for g in gathered))

    def _push_adapters(self, version: int, targets: list[SyncTarget]) -> PushReport:
        from megatron_rl.sync.adapter_push import AdapterSender
        from megatron_rl.train.lora import spec_of
        from megatron_rl.train.lora_weights import gather_peft_tensors, peft_config

        tensors = gather_peft_tensors(self.model_chunks)  # collective; the whole model's on rank 0
        report = None
        error = None
        if tensors is not None:
            try:
                report = AdapterSender().send(version, tensors, peft_config(spec_of(self.model_chunks), self.base_model),
                                              targets)
            except Exception as e:  # every rank raises, not only the sender: the trainers stay in step
                error = f"{type(e).__name__}: {e}"
        shared = [(report, error)]
        dist.broadcast_object_list(shared, src=0)
        report, error = shared[0]
        if error is not None:
            raise WeightSyncError(error)
        return report

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
