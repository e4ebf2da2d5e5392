"""`latentserve` command line: generate, serve, verify-sleep."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .config import ConfigError
from .engine_config import add_engine_args, engine_kwargs
from .sampling_params import InvalidRequest


def cmd_generate(args: argparse.Namespace) -> int:
    from .llm import LLM
    from .sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sample_seed)
    try:
        token_prompts = [{"prompt_token_ids": [int(t) for t in p.split(",")]} for p in args.prompt_token_ids]
    except ValueError as e:
        raise InvalidRequest(f"--prompt-token-ids takes comma-separated integers: {e}") from None
    prompts = list(args.prompt) + token_prompts
    if not prompts:
        raise InvalidRequest("give --prompt TEXT or --prompt-token-ids 1,2,3")
    llm = LLM(**engine_kwargs(args), distributed_executor_backend=args.distributed_executor_backend,
              enforce_eager=args.enforce_eager)
    try:
        for out in llm.generate(prompts, params):
            o = out.outputs[0]
            if args.json:
                print(json.dumps({"prompt": out.prompt, "text": o.text, "token_ids": o.token_ids,
                                  "finish_reason": o.finish_reason}))
            else:
                shown = o.text if o.text is not None else f"(no tokenizer) token ids {o.token_ids}"
                print(f"--- {out.prompt!r}\n{shown}\n[{o.finish_reason}, {len(o.token_ids)} tokens]")
    finally:
        llm.shutdown()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .server.app import serve

    return serve(args)


def cmd_verify_sleep(args: argparse.Namespace) -> int:
    from .server.verify_sleep import main as verify_main

    return verify_main(args)


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="latentserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate offline through the TP ranks")
    add_engine_args(g)
    g.add_argument("--prompt", action="append", default=[])
    g.add_argument("--prompt-token-ids", action="append", default=[], metavar="1,2,3")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--sample-seed", type=int, default=None)
    g.add_argument("--json", action="store_true")
    g.add_argument("--distributed-executor-backend", default="ray", choices=["ray", "mp", "uni"],
                   help="ray: a Ray actor per rank; mp: a process per rank, no Ray; uni: TP 1 in this process")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="serve the OpenAI API with /sleep and /wake_up")
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--admin-key", default=os.environ.get("LATENTSERVE_ADMIN_KEY"))
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--rank-deadline-s", type=float, default=None,
                   help="deadline for sleep/wake/update on every rank (default env LATENTSERVE_RANK_DEADLINE_S or 120)")
    s.add_argument("--request-timeout-s", type=float, default=None,
                   help="longest a generation request may take (default env LATENTSERVE_REQUEST_TIMEOUT_S or 600)")
    s.add_argument("--stream-interval", type=_at_least_one, default=1,
                   help="streamed tokens a chunk (vLLM's option): a stream's first token goes at once, then a "
                        "chunk once this many are new or it ends; more than 1 trades smoothness for fewer writes "
                        "a second at many streams (default 1)")
    s.add_argument("--enable-test-hooks", action="store_true",
                   help="allow state-changing collective_rpc hooks (negative controls); never in production")
    s.add_argument("--weight-snapshot", choices=("off", "host"), default="off",
                   help="host: copy the parameters each group/refs weight update wrote to the controller's "
                        "memory, so POST /restart brings them back (path updates are reloaded from the path)")
    s.add_argument("--distributed-executor-backend", default="ray", choices=["ray", "mp"],
                   help="ray: a Ray actor per rank (the product); mp: a process per rank on this machine, no Ray "
                        "(no Ray object-store weight updates)")
    s.set_defaults(func=cmd_serve)

    v = sub.add_parser("verify-sleep", help="the seed's sleep test plan with its negative control")
    add_engine_args(v)
    v.add_argument("--url", default=None, help="use a running service instead of starting one")
    v.add_argument("--admin-key", default=os.environ.get("LATENTSERVE_ADMIN_KEY"))
    v.add_argument("--prompts", type=int, default=16)
    v.add_argument("--tokens", type=int, default=48)
    v.set_defaults(func=cmd_verify_sleep)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, InvalidRequest, ValueError) as e:
        print(f"latentserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
