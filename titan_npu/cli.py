"""`titan-npu <command>`: one entry for every tool; user errors print one line, `--debug` shows the traceback."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import NoReturn

# command -> (module under titan_npu.commands, one-line help); each module's main takes argv (list[str]) and returns
# an exit code.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("train", "train a model from a config (same as python train.py)"),
    "prepare-data": ("prepare_data", "tokenize a corpus into binary shards or JSONL"),
    "train-tokenizer": ("train_tokenizer", "train a BPE tokenizer on a corpus"),
    "export": ("export", "export a checkpoint to a full .pt or Hugging Face"),
    "import": ("import_weights", "convert Hugging Face / Meta weights to a .pt"),
    "init-weights": ("init_weights", "write a config's initial weights as a checkpoint any layout starts from"),
    "plan": ("plan", "plan memory and parallel layout before launch"),
    "doctor": ("doctor", "check versions, devices, environment and collectives"),
    "generate": ("generate", "sample text from a checkpoint"),
    "eval": ("eval", "evaluate a checkpoint on lm-evaluation-harness tasks (offline)"),
    "report": ("report", "plot and summarise a run from its log dir"),
    "bench": ("bench", "measure throughput, MFU and memory"),
}


def _usage() -> str:
    width = max(len(c) for c in COMMANDS)
    lines = ["usage: titan-npu <command> [options]   (titan-npu <command> --help for its options)", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a tool whose reader went away
EXIT_REFUSED = 2  # bad input refused (or a run halted) with one line saying why; see docs/reliability.md
PEER_REPORT_WAIT_S = 60.0  # how long a silent rank waits for local rank 0 to have said the same refusal
LOST_PEER_WAIT_S = 10.0  # how long a rank whose peer ended waits for torchrun to stop it (it polls every 0.1 s)


def run_command(func, argv: list[str]) -> int:
    """Run a command's main; a TitanError, or an OSError on a file it read or wrote (no space, permission denied,
    ...), becomes one line on stderr and exit code 2 (traceback with --debug or TITAN_DEBUG=1).

    Under a launcher (torchrun), an error that every rank meets alike (marked `same_on_every_rank`: found before
    the process group forms) is printed once per node, by local rank 0; one found later is printed by each rank
    that meets it, prefixed with its rank. Each rank also leaves the line in torchrun's error file, so that
    torchrun's failure summary names it.
    """
    from titan_npu.errors import TitanError
    from titan_npu.os_errors import describe_os_error

    debug = "--debug" in argv or bool(_env_flag("TITAN_DEBUG"))
    try:
        return int(func(argv) or 0)
    except TitanError as e:
        if debug:
            raise
        line = f"{type(e).__name__}: {e}"
        if getattr(e, "peer_lost", False):
            # Said now, but left for torchrun's summary only if torchrun has not stopped this rank within the wait:
            # an error file written at once carries an earlier time than torchrun's own record of the lost rank,
            # and its summary would name this rank as the root cause.
            _report(line, False, record=False)
            _wait_to_be_stopped()
            _record_for_torchrun(line)
        else:
            _report(line, getattr(e, "same_on_every_rank", False))
        return EXIT_REFUSED
    except BrokenPipeError as e:
        if e.filename is not None or debug:
            raise
        # What read the output stopped reading (`titan-npu plan ... | head`): quiet, as a shell tool killed by SIGPIPE.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush must not fail again
        except (OSError, ValueError):
            pass
        return EXIT_BROKEN_PIPE
    except OSError as e:  # a file the command read or wrote: no space, permission denied, read-only, ...
        if debug:
            raise
        _report(f"{type(e).__name__}: {describe_os_error(e)}", getattr(e, "same_on_every_rank", False))
        return EXIT_REFUSED
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _report(line: str, same_on_every_rank: bool, record: bool = True) -> None:
    """Say a refusal's line on stderr (once per node when every rank met it alike) and, with `record`, in
    torchrun's error file."""
    rank, local_rank = _env_flag("RANK"), _env_flag("LOCAL_RANK") or _env_flag("RANK")
    if not local_rank.isdigit() or local_rank == "0":  # a rank that is not a number is reported as such
        print(line, file=sys.stderr, flush=True)
        if record:
            _record_for_torchrun(line)  # after the line is out: the other ranks wait for this file
    elif same_on_every_rank:
        _record_for_torchrun(line)
        # torchrun stops every worker once one has exited: stay until local rank 0 has said it.
        if not _local_rank_zero_reported():
            print(f"[rank{rank}] {line}", file=sys.stderr)
    else:
        if record:
            _record_for_torchrun(line)
        print(f"[rank{rank}] {line}", file=sys.stderr)


def _wait_to_be_stopped() -> None:
    """A rank that stops because a peer of its node ended: under torchrun, give the launcher (which stops every
    worker once one has ended) the time to see that peer first, so that its summary names the lost rank as the root
    cause, not this one."""
    import time

    if _env_flag("TORCHELASTIC_ERROR_FILE"):
        time.sleep(LOST_PEER_WAIT_S)


def _record_for_torchrun(line: str) -> None:
    """Write the refusal where torchrun looks for a worker's reason (TORCHELASTIC_ERROR_FILE), if it is set."""
    path = _env_flag("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json
    import time

    try:
        with open(path, "w") as f:
            # torchrun's own layout (ErrorHandler.record_exception): its summary shows py_callstack; ours is the line.
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass  # only torchrun's summary loses the line; stderr has it


def _local_rank_zero_reported() -> bool:
    """Wait (up to PEER_REPORT_WAIT_S) for local rank 0's torchrun error file (attempt_N/0/error.json beside
    ours); False without torchrun or when it never comes."""
    import time
    from pathlib import Path

    path = _env_flag("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    peer = Path(path).parent.parent / "0" / Path(path).name
    deadline = time.monotonic() + PEER_REPORT_WAIT_S
    while not (peer.is_file() and peer.stat().st_size > 0):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _env_flag(name: str) -> str:
    import os

    return os.environ.get(name, "")


def run_as_process(entry: Callable[[], int | None]) -> NoReturn:
    """Run a process's entry and end the process with its exit code (exit_process); an error that escapes it is
    printed as Python prints it (sys.excepthook) and gives 1."""
    try:
        code = entry()
    except SystemExit as e:
        code = e.code
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    exit_process(code)


def exit_process(code: int | str | None) -> NoReturn:
    """End this process with `code`, as sys.exit(code) would, once the exit handlers have run and the output is
    flushed, but without tearing the interpreter down.

    torch's C++ threads outlive the process groups: destroy_process_group does not join gloo's worker threads, and a
    worker that drops the last C++ reference to a tensor takes the interpreter lock to release the tensor's Python
    object. When that happens while the interpreter is being torn down, Python ends the thread inside a noexcept
    destructor and the C++ runtime aborts the whole process ("terminate called without an active exception",
    SIGABRT): a finished run would exit as a failed one. Here everything Python runs at exit runs while the
    interpreter is whole (those threads can still take the lock), and the process then ends at once.
    """
    import atexit
    import threading

    if code is None or isinstance(code, int):
        status = code or 0
    else:  # sys.exit("message"): the message on stderr, exit 1
        print(code, file=sys.stderr)
        status = 1
    # What a normal exit runs, in its order: wait for the threads that are not daemons, then the exit handlers
    # (logging's flush, multiprocessing's children, wandb's and torch's own).
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can be said on it
            pass
    os._exit(status)


def main(argv: list[str] | None = None) -> int:
    """Dispatch `titan-npu <command> ...` to the command's module.

    Without argv (the `titan-npu` console script) it is the process's entry and ends the process (exit_process).
    """
    if argv is None:
        run_as_process(lambda: main(sys.argv[1:]))
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from titan_npu import __version__

        print(f"titan-npu {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        print(f"titan-npu: unknown command '{name}'{hint}; run 'titan-npu --help' for the list", file=sys.stderr)
        return 2
    module, _ = COMMANDS[name]
    return run_command(importlib.import_module(f"titan_npu.commands.{module}").main, rest)


if __name__ == "__main__":
    run_as_process(lambda: main(sys.argv[1:]))
