"""An RLHF-style loop against a running latentserve: rollouts, sleep, train, wake, sync, rollouts.

The trainer is a Ray actor in the service's Ray cluster holding its own TP-1 copy of the
policy (the same dummy weights the service starts with). Each cycle it trains lm_head so the
policy's next token after every prompt becomes a new target, then syncs the weights through
one of the three transports (a checkpoint path, a process-group broadcast, Ray object refs).
The service's greedy rollouts after the sync must start with the target and follow the
trainer's own greedy prediction, and every response carries the new weight_version.

    python examples/rlhf_loop.py                 # starts a TP-2 service on the tiny preset
    python examples/rlhf_loop.py --url URL --admin-key KEY
"""

from __future__ import annotations

import os

# The embedded Ray cluster uses token auth; a driver joining it must too (read at ray import).
os.environ.setdefault("RAY_AUTH_MODE", "token")

import argparse  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import ray  # noqa: E402
import torch  # noqa: E402

from service.client import Client  # noqa: E402

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18, 19, 20, 21, 22]]
TRANSPORTS = ("path", "group", "refs")


class Trainer:
    """A TP-1 copy of the policy that trains lm_head with plain SGD on a next-token objective."""

    def __init__(self, preset: str, seed: int = 0):
        from service.config import PRESETS
        from service.model.model import CausalLM
        from service.parallel import TPGroup
        from service.weights import init_dummy_weights, materialize_plain

        torch.set_num_threads(1)
        self.cfg = PRESETS[preset]
        with torch.device("meta"):
            model = CausalLM(self.cfg, TPGroup.single(), dtype=torch.float32)
        self.model = materialize_plain(model, "cpu")
        init_dummy_weights(self.model, self.cfg, TPGroup.single(), seed=seed)

    def _logits(self, tokens: list[int]) -> torch.Tensor:
        from service.engine.plan import SeqChunk
        from service.model.attention import AttnMetadata

        meta = AttnMetadata.build([SeqChunk(0, list(tokens), 0, [])], 16, torch.device("cpu"))
        hidden = self.model(torch.tensor(tokens), meta, None)
        return self.model.compute_logits(hidden[meta.logits_indices])[0]

    def train(self, target: int, steps: int = 60, lr: float = 0.5) -> dict:
        head = self.model.lm_head.weight
        head.requires_grad_(True)
        opt = torch.optim.SGD([head], lr=lr)
        for _ in range(steps):
            loss = sum(torch.nn.functional.cross_entropy(self._logits(p)[None], torch.tensor([target]))
                       for p in PROMPTS) / len(PROMPTS)
            opt.zero_grad()
            loss.backward()
            opt.step()
        head.requires_grad_(False)
        return {"loss": float(loss.detach())}

    @torch.no_grad()
    def greedy(self, max_tokens: int) -> list[list[int]]:
        outs = []
        for p in PROMPTS:
            toks = list(p)
            for _ in range(max_tokens):
                toks.append(int(self._logits(toks).argmax()))
            outs.append(toks[len(p):])
        return outs

    def push(self, url: str, admin_key: str, transport: str) -> dict:
        from service.weights import export_state, save_checkpoint

        state = export_state(self.model)
        with Client(url, admin_key, timeout=600) as c:
            if transport == "path":
                path = tempfile.mkdtemp(prefix="rlhf-policy-")
                save_checkpoint(self.cfg, path, state.items())
                return c.update_weights(path=path)
            if transport == "group":
                return c.update_weights_from_group(state)
            return c.update_weights_from_refs(state)


def rollout(c: Client, max_tokens: int) -> tuple[list[list[int]], int]:
    r = c.completions(PROMPTS, max_tokens=max_tokens, temperature=0, ignore_eos=True)
    choices = sorted(r["choices"], key=lambda ch: ch["index"])
    return [ch["token_ids"] for ch in choices], r["weight_version"]


def run(url: str, admin_key: str, cycles: int, max_tokens: int, preset: str) -> int:
    c = Client(url, admin_key, timeout=600)
    ray.init(address=c.status()["ray"]["address"], namespace="rlhf-example", logging_level="ERROR")
    trainer = ray.remote(num_cpus=0)(Trainer).remote(preset)
    tokens, version = rollout(c, max_tokens)
    print(f"cycle 0: weight_version={version} first tokens={[t[0] for t in tokens]}", flush=True)
    failures = 0
    for cycle in range(1, cycles + 1):
        transport = TRANSPORTS[(cycle - 1) % len(TRANSPORTS)]
        target = 100 + 37 * cycle
        t0 = time.perf_counter()
        c.sleep(level=2)  # free the accelerator for the trainer
        loss = ray.get(trainer.train.remote(target))["loss"]
        predicted = ray.get(trainer.greedy.remote(max_tokens))
        c.wake_up(["weights"])
        sync = ray.get(trainer.push.remote(url, admin_key, transport))
        c.wake_up(["kv_cache"])
        tokens, served_version = rollout(c, max_tokens)
        first_ok = all(t[0] == target for t in tokens)
        same = sum(a == b for a, b in zip(tokens, predicted))
        ok = first_ok and same == len(PROMPTS) and served_version == sync["weight_version"] == version + 1
        failures += not ok
        print(f"cycle {cycle}: transport={transport} loss={loss:.3f} weight_version={served_version} "
              f"first tokens={[t[0] for t in tokens]} (target {target}) "
              f"rollouts equal to the trainer's prediction: {same}/{len(PROMPTS)} "
              f"[{time.perf_counter() - t0:.1f}s] {'ok' if ok else 'MISMATCH'}", flush=True)
        version = served_version
    ray.shutdown()
    print("all cycles used the new weights" if not failures else f"{failures} cycle(s) did not match")
    return 1 if failures else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running service (default: start one)")
    ap.add_argument("--admin-key", default=os.environ.get("LATENTSERVE_ADMIN_KEY"))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--preset", default="tiny")
    args = ap.parse_args(argv)
    if args.url:
        return run(args.url, args.admin_key, args.cycles, args.max_tokens, args.preset)
    from service.server.launch import start_healthy

    server = start_healthy(["--model", args.preset, "--tp", str(args.tp), "--enable-sleep-mode"], 600,
                           admin_key="generated")[0]
    try:
        return run(server.url, server.admin_key, args.cycles, args.max_tokens, args.preset)
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
