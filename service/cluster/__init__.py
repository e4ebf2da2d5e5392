"""The model's TP ranks and their lifecycle, above the model:

- `executor`: the executor interface (`submit`, `call_ranks` with one deadline) and
  `ray_executor` / `mp_executor` / `uni_executor`, its three backends (`backends.make_executor`);
- `rank_actor`, `worker` (+ `worker_weights`, `worker_rpc`): one rank, its shard, sleep and
  weight updates; `engine_loop`: the engine thread on rank 0; `recovery`: re-arming every rank
  after a failed step;
- `coordinator`: the one lifecycle path that the offline `LLM` and the HTTP
  controller both take for sleep, wake, weight updates, pause/resume and restart.
"""
