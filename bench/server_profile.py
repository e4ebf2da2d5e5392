"""py-spy samples of a running server (the HTTP process and its rank processes) over one load phase,
and where each process's time went: `bench/serve.py --py-spy PATH`.

Why: at 256 streams on the GPU the HTTP process runs near a whole core (`api_cpu` 0.75-0.8, runs
78-79) and clients wait ~100 ms longer for a first token than the server's own first-token clock
says; `--stream-interval 4` did not lower that CPU, so per-token socket writes are not it.

    python3 bench/server_profile.py FILE     # a raw py-spy file's summary again
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import time


class Recording:
    """py-spy recording a process and its children (raw collapsed stacks, a frame for each thread)
    from construction until stop(). Without --idle: a sample is a thread py-spy saw running. Where
    py-spy falls behind (many processes on few cores) it takes fewer samples, so shares are of the
    samples taken, and the controller's `process_cpu_s` gives the HTTP process's absolute CPU."""

    def __init__(self, py_spy: str, pid: int, path: str, rate: int = 100) -> None:
        self.path, self.rate, self.t0 = path, rate, time.monotonic()
        cmd = [py_spy, "record", "--pid", str(pid), "--subprocesses", "--threads", "--nonblocking",
               "--rate", str(rate), "--format", "raw", "--output", path]
        try:
            with open(path + ".err", "w") as err:  # the child keeps its own copy of the descriptor
                self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        except OSError as e:
            print(f"py-spy did not start ({e}): no server profile", file=sys.stderr)
            self.proc = None

    def stop(self, timeout: float = 60.0) -> str:
        """Stop (SIGINT makes py-spy write what it sampled) and summarize."""
        seconds = time.monotonic() - self.t0
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return f"{self.rate * seconds:.0f} ticks asked\n" + summarize(self.path)


def summarize(path: str, top: int = 10) -> str:
    """Per thread of each process (the innermost `process` frame py-spy adds with --subprocesses):
    its running samples, and the functions holding most of them at the leaf (self time; a C call
    counts in its Python caller), as shares of the thread's samples."""
    if not os.path.exists(path):
        err = path + ".err"
        return f"no profile ({open(err).read().strip()[-300:] if os.path.exists(err) else 'py-spy wrote nothing'})"
    leaves: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            # Command lines may hold ';' and '"' (a spawned worker's `-c "...; spawn_main(...)"`), so
            # the thread frame is found first and the innermost process before it.
            thread = THREAD.search(stack)
            cut = thread.start() if thread else len(stack)
            procs = list(PROCESS.finditer(stack, 0, cut))
            proc = _process_label(procs[-1].group(1), stack[procs[-1].end():cut]) if procs else "?"
            label = thread.group(1)[:48] if thread else "thread ?"
            leaves[(proc, label)][stack.rsplit(";", 1)[-1][:110]] += int(count)
    lines, most = [], max((sum(c.values()) for c in leaves.values()), default=0)
    for (proc, thread), counts in sorted(leaves.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(counts.values())
        if total < 0.1 * most:
            continue  # a thread that mostly waits
        lines.append(f"{proc} {thread}: {total} running samples")
        lines += [f"    {n / total:6.3f}  {fr}" for fr, n in counts.most_common(top)]
    return "\n".join(lines) or "no samples"


PROCESS = re.compile(r"(?:^|;)process (\d+):")
THREAD = re.compile(r";(thread \(\d+\): [^;]*)")


def _process_label(pid: str, cmd: str) -> str:
    words = cmd.strip('"').split()
    if "spawn_main" in cmd:
        name = "spawned worker"
    elif "-m" in words:
        name = " ".join(words[words.index("-m") + 1:words.index("-m") + 3])
    else:
        name = os.path.basename(words[1]) if len(words) > 1 else cmd[:40]
    return f"{pid} {name}"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python3 bench/server_profile.py PYSPY_RAW_FILE")
    print(summarize(sys.argv[1]))
