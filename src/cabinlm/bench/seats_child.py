"""One mode of `cabinlm bench --seats N` in a process of its own, so that its memory (RSS, sessions,
llama.cpp's context) is its own: run_in_child starts `python -m cabinlm.bench.seats_child ...`, which
runs bench/seats.run_seats (or, mode "llama.cpp", bench/llama_seats.run_llama_seats) and prints its
figures as one JSON line."""

from __future__ import annotations

from pathlib import Path

from cabinlm.bench.script import SYSTEM
from cabinlm.bench.seats import run_seats


def run_in_child(artifact: Path, seats: int, rounds: int, max_new: int, threads: int | None, seed: int,
                 mode: str, timeout_s: float, system: str = SYSTEM, gguf: Path | None = None,
                 replies: list[list[int]] | None = None, speculative: bool | None = None,
                 adapters: tuple[str, ...] = ()) -> dict:  # fmt: skip
    """run_seats (or, mode "llama.cpp", run_llama_seats on GGUF with REPLIES) in a fresh process: its
    figures (SeatsRun.to_dict, with "replies"). adapters: seat i's adapter name (run_seats)."""
    import json
    import subprocess
    import sys
    import tempfile

    from cabinlm.contract.errors import CabinlmError

    drafting = {None: "default", True: "on", False: "off"}[speculative]
    cmd = [sys.executable, "-m", "cabinlm.bench.seats_child", str(artifact), str(seats), str(rounds), str(max_new),
           str(threads or 0), str(seed), mode, system, drafting, ",".join(adapters)]  # fmt: skip
    tmp = None
    if mode == "llama.cpp":
        tmp = tempfile.NamedTemporaryFile("w", suffix=".json", prefix="cabinlm-seats-", delete=False)
        json.dump(replies, tmp)
        tmp.close()
        cmd += [str(gguf), tmp.name]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise CabinlmError(f"--seats {seats} ({mode}) ran past --time-limit {timeout_s:g} s") from e
    finally:
        if tmp is not None:
            Path(tmp.name).unlink(missing_ok=True)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise CabinlmError(f"--seats {seats} ({mode}) failed: {last}")
    return json.loads(p.stdout.strip().splitlines()[-1])


if __name__ == "__main__":  # one mode in a process of its own (run_in_child)
    import json
    import sys

    art, n, rounds, max_new, threads, seed, mode, system, drafting, names = sys.argv[1:11]
    if mode == "llama.cpp":
        from cabinlm.bench.llama_seats import run_llama_seats

        gguf, replies_file = sys.argv[11:13]
        forced = json.loads(Path(replies_file).read_text())
        done = run_llama_seats(Path(art), Path(gguf), int(n), int(rounds), int(max_new), int(threads) or 2, int(seed),
                               system, forced)  # fmt: skip
        extra = {"config": done.config, "greedy_agreement": list(done.agree)}  # type: ignore[attr-defined]
    else:
        done = run_seats(Path(art), int(n), int(rounds), int(max_new), int(threads) or None, int(seed), mode, system,
                         {"default": None, "on": True, "off": False}[drafting], names.split(",") if names else ())  # fmt: skip
        extra = {}
    print(json.dumps({**done.to_dict(), **extra, "replies": done.replies, "warmup_replies": done.warmup_replies}))
